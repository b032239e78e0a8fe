"""Which database errors are an outage (spool and retry) and which mean "this row cannot be written".

An outage passes: the record waits on disk and is written when the database answers again.
Anything else would fail the same way on every retry, so the record goes to the dead-letter
spool instead, loudly (`proxy.recorder`). When in doubt, call it an outage: retrying a row
that cannot be written costs a retry loop that `/readyz` shows; calling an outage a bad row
loses the record from the database until someone replays it.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

__all__ = ["is_outage", "sqlstate"]

# SQLSTATE classes and codes that say "not now", never "not this row":
#   08 connection exception; 53 insufficient resources (53300 too many connections, disk
#   full); 57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot connect now (shutting
#   down, starting up, in recovery); 57014 statement cancelled; 58 system (I/O) error;
#   40001 serialization failure, 40P01 deadlock; 55P03 lock not available; 25006 read-only
#   transaction (a failover left us on a standby).
_TRANSIENT_CLASSES = ("08", "53", "58")
_TRANSIENT_CODES = frozenset({"57P01", "57P02", "57P03", "57P04", "57P05", "57014", "40001", "40P01", "55P03",
                              "55006", "25006", "25P03"})
def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a PostgreSQL error, whichever driver raised it (psycopg or asyncpg)."""
    for err in (getattr(exc, "orig", None), exc, getattr(exc, "__cause__", None)):
        if err is None:
            continue
        for attr in ("sqlstate", "pgcode"):
            code = getattr(err, attr, None)
            if isinstance(code, str) and len(code) == 5:
                return code
        cause = getattr(err, "__cause__", None)
        code = getattr(cause, "sqlstate", None)
        if isinstance(code, str) and len(code) == 5:
            return code
    return None


def is_outage(exc: BaseException) -> bool:
    """Errors that mean "the database is not there (now)", worth spooling for, not a bad batch."""
    if isinstance(exc, (OSError, ConnectionError, asyncio.TimeoutError)):
        return True
    code = sqlstate(exc)
    if code is not None:
        return code.startswith(_TRANSIENT_CLASSES) or code in _TRANSIENT_CODES
    if isinstance(exc, IntegrityError):
        return False
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        message = str(exc.orig if exc.orig is not None else exc).lower()
        if isinstance(exc, OperationalError):
            # psycopg and sqlite3 raise OperationalError for lost connections and locks; sqlite3
            # also for a broken schema ("no such table"), which no retry fixes.
            return "no such" not in message and "syntax error" not in message
        # asyncpg's errors without a SQLSTATE (connection closed, protocol) arrive as DBAPIError.
        return any(word in message for word in ("connect", "closed", "terminat", "reset", "broken pipe", "timeout"))
    return False
