"""The dashboard's login cookie and CSRF tokens: what the server signs, and what it accepts.

Both are signed with keys only the server has, so a cookie or a form field that someone else
chose (another service on the same host, a sibling subdomain: either can set cookies for the
dashboard's host, whatever its port) is refused, whatever it holds. The rules, all here:

- **Keys.** Derived (HKDF-SHA256, :func:`derive`) from ``secret`` and the access ``token``
  together: servers given the same ones (replicas behind a load balancer, a restart) accept
  each other's cookies and forms, and changing either ends every login. With neither, the key
  is random per process: forms drawn before a restart are refused (reload the page), and
  several processes need a ``secret``.
- **The login cookie** (``sqla_jobs_auth``, with a token only) holds a random session id, the
  login's time and its own issue time, signed; never the token or anything derived from it
  alone. It is refused 401 once it went unused for ``lifetime`` (its issue time is that old)
  or its login is ``max_age`` old, and 403 when its signature or times are wrong. It is
  re-issued (a fresh issue time: a new value, the same session) on a request once a quarter
  of ``lifetime`` has passed, and each login starts a new session.
- **The CSRF token** of a form is ``HMAC(key, nonce . session)``: the nonce is the
  ``sqla_jobs_csrf`` cookie (random per browser), the session is the login's id (empty
  without a login cookie: no token, or ``Authorization: Bearer``). A pair that someone else
  made does not verify; one of another login is refused with that login's session.
- **Cookies** are ``HttpOnly``, ``SameSite=Strict``, on the dashboard's path, and ``Secure``
  when the request came over HTTPS (the request's scheme: behind a TLS proxy, the server must
  be told, e.g. uvicorn's ``--proxy-headers`` with ``FORWARDED_ALLOW_IPS``).

Times are this process's clock in whole seconds (:func:`now`); a cookie issued up to
:data:`CLOCK_SKEW` seconds in the future (another replica's clock) is accepted.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Final

from starlette.requests import Request
from starlette.responses import Response

from sqla_jobs.errors import ConfigurationError

__all__ = [
    "AUTH_COOKIE",
    "CLOCK_SKEW",
    "CSRF_COOKIE",
    "MIN_SECRET_LENGTH",
    "SESSION_LIFETIME",
    "SESSION_MAX_AGE",
    "Denied",
    "Keys",
    "Login",
    "cookie_path",
    "csrf_matches",
    "csrf_nonce",
    "derive",
    "now",
]

CSRF_COOKIE: Final = "sqla_jobs_csrf"
AUTH_COOKIE: Final = "sqla_jobs_auth"
#: A login ends once unused this long (its cookie's issue time is that old) ...
SESSION_LIFETIME: Final = timedelta(hours=12)
#: ... and this long after it began, used or not.
SESSION_MAX_AGE: Final = timedelta(days=7)
#: Browsers keep a cookie at most 400 days.
_LONGEST: Final = timedelta(days=400)
MIN_SECRET_LENGTH: Final = 16
#: Seconds a cookie's times may be ahead of this process's clock (another replica's clock).
CLOCK_SKEW: Final = 60
#: The login cookie is re-issued once this fraction of its lifetime has passed.
_ROTATE_FRACTION: Final = 4
_NONCE: Final = re.compile(r"[A-Za-z0-9_-]{43}")
_LOGIN: Final = re.compile(
    r"1\.(?P<session>[A-Za-z0-9_-]{22})\.(?P<started>[0-9]{1,12})\.(?P<issued>[0-9]{1,12})"
    r"\.(?P<mac>[A-Za-z0-9_-]{43})"
)


def now() -> int:
    """This process's clock, in whole seconds (the tests move it)."""
    return int(time.time())


def derive(material: bytes, purpose: str) -> bytes:
    """A 32-byte key for ``purpose`` from ``material``: HKDF-SHA256 (RFC 5869), one block."""
    prk = hmac.new(b"sqla_jobs dashboard", material, hashlib.sha256).digest()
    return hmac.new(prk, purpose.encode() + b"\x01", hashlib.sha256).digest()


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _seconds(field: str, value: object) -> int:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigurationError(f"{field} must be a timedelta or seconds, not {value!r}")
    if not 60 <= seconds <= _LONGEST.total_seconds():
        raise ConfigurationError(f"{field} must be between 1 minute and 400 days, got {value!r}")
    return int(seconds)


class Denied(Exception):
    """A request without a valid login: ``status`` (401 or 403) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Login:
    """A login as its cookie holds it (times in unix seconds)."""

    session: str  # random per login; CSRF tokens are bound to it
    started: int  # when the token was given
    issued: int  # when this cookie was issued


class Keys:
    """The server's keys: :meth:`login_cookie` and :meth:`read_login` for the login cookie,
    :meth:`csrf_token` for forms (checked by :func:`csrf_matches`), :meth:`set_cookies` for
    what a response sets."""

    def __init__(
        self,
        *,
        secret: str | bytes | None,
        token: str | None,
        lifetime: timedelta | float,
        max_age: timedelta | float,
    ) -> None:
        given: object = secret
        if given is not None:
            if not isinstance(given, str | bytes) or len(given) < MIN_SECRET_LENGTH:
                raise ConfigurationError(
                    f"secret must be a string or bytes of at least {MIN_SECRET_LENGTH} characters"
                )
            secret_bytes = given.encode() if isinstance(given, str) else given
        elif token is None:
            secret_bytes = secrets.token_bytes(32)  # per process: see the module's docstring
        else:
            secret_bytes = b""
        token_bytes = b"" if token is None else token.encode()
        # Both, length-prefixed: a new token ends every login even with the same secret.
        material = len(secret_bytes).to_bytes(4, "big") + secret_bytes + token_bytes
        self.lifetime = _seconds("session_lifetime", lifetime)
        self.max_age = _seconds("session_max_age", max_age)
        if self.max_age < self.lifetime:
            raise ConfigurationError("session_max_age must not be shorter than session_lifetime")
        self._login_key = derive(material, "login cookie v1")
        self._csrf_key = derive(material, "csrf token v1")

    # -- the login cookie -----------------------------------------------------------------

    def new_login(self, at: int) -> Login:
        """A new session (each login: a stolen cookie of an earlier one is not renewed)."""
        return Login(session=secrets.token_urlsafe(16), started=at, issued=at)

    def login_cookie(self, login: Login) -> str:
        body = f"1.{login.session}.{login.started}.{login.issued}"
        return f"{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._login_key, body.encode(), hashlib.sha256).digest())

    def read_login(self, value: str, at: int) -> Login:
        """The login ``value`` (a cookie) holds, or :class:`Denied`: 403 for a cookie this
        server did not issue, 401 for one that expired."""
        match = _LOGIN.fullmatch(value)
        if match is None or not hmac.compare_digest(
            match["mac"].encode(), self._mac(value.rpartition(".")[0]).encode()
        ):
            raise Denied(403, "wrong access token (log in again)")
        login = Login(match["session"], int(match["started"]), int(match["issued"]))
        if login.started > login.issued or login.issued > at + CLOCK_SKEW:
            raise Denied(403, "wrong access token (log in again)")
        if at - login.issued > self.lifetime or at - login.started > self.max_age:
            raise Denied(401, "the login has expired: log in again")
        return login

    def renewed(self, login: Login, at: int) -> Login | None:
        """``login`` re-issued now when a quarter of its lifetime has passed, else None."""
        if at - login.issued >= self.lifetime // _ROTATE_FRACTION:
            return replace(login, issued=at)
        return None

    def cookie_max_age(self, login: Login, at: int) -> int:
        return max(1, min(login.issued + self.lifetime, login.started + self.max_age) - at)

    # -- CSRF -------------------------------------------------------------------------------

    def csrf_token(self, nonce: str, session: str) -> str:
        """The form field for the browser's ``nonce`` cookie and the login's ``session``."""
        message = f"{nonce}.{session}".encode()
        return _b64(hmac.new(self._csrf_key, message, hashlib.sha256).digest())

    # -- cookies on a response --------------------------------------------------------------

    def set_cookies(
        self,
        request: Request,
        response: Response,
        *,
        nonce: str | None = None,
        login: Login | None = None,
        at: int = 0,
    ) -> None:
        """Set the CSRF ``nonce`` cookie (when the request did not carry it) and the
        ``login`` cookie on ``response``, with the attributes of the module's docstring."""
        secure = request.url.scheme == "https"
        path = cookie_path(request)
        if nonce is not None and request.cookies.get(CSRF_COOKIE) != nonce:
            response.set_cookie(
                CSRF_COOKIE, nonce, path=path, secure=secure, httponly=True, samesite="strict"
            )
        if login is not None:
            response.set_cookie(
                AUTH_COOKIE,
                self.login_cookie(login),
                max_age=self.cookie_max_age(login, at),
                path=path,
                secure=secure,
                httponly=True,
                samesite="strict",
            )

    @staticmethod
    def end_login(request: Request, response: Response) -> None:
        """Delete the login cookie (same path and attributes as it was set with)."""
        response.delete_cookie(
            AUTH_COOKIE,
            path=cookie_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )


def csrf_nonce(request: Request) -> str:
    """The browser's CSRF nonce cookie, or a new one to set."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    return cookie if _NONCE.fullmatch(cookie) else secrets.token_urlsafe(32)


def csrf_matches(request: Request, token: str, sent: str) -> bool:
    """Whether ``sent`` (a form's field) is ``token``, the request's own CSRF token
    (:meth:`Keys.csrf_token` of its nonce cookie and login), compared in constant time; never
    without a nonce cookie (a new nonce's token could not have been sent)."""
    if not (sent and _NONCE.fullmatch(request.cookies.get(CSRF_COOKIE, ""))):
        return False
    return hmac.compare_digest(sent.encode(), token.encode())


def cookie_path(request: Request) -> str:
    """The dashboard's own path (where it is mounted): its cookies go nowhere else."""
    return str(request.scope.get("root_path", "")).rstrip("/") + "/"
