"""HTTP routes. Thin: parse ids, take collaborators from `app.state`, return or raise."""
