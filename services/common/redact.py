"""Secrets kept out of what is printed: logs, error messages, start-up lines."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["masked_url"]


def masked_url(url: str) -> str:
    """``url`` with its password (``scheme://user:password@host``) shown as ``***``.

    A Redis or Milvus URL carries the password that authenticates to it, and the URL is what
    an error names: unmasked, it reached pod logs, terminals and other tenants' error messages.
    A URL that does not parse is returned as it is only when it has no ``@`` (else masked whole).
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "***" if "@" in url else url
    if not password:
        return url
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return parts._replace(netloc=f"{user}:***@{hostinfo}").geturl()
