// Rolltap dashboard: a filter change submits the form (the page works without this script too).
document.querySelectorAll("form.filters select").forEach((el) => {
  el.addEventListener("change", () => el.form.submit());
});
