"""``[[providers.NAME.accounts]]``: a provider's several accounts (SPEC L13).

Each account is a table with a ``name`` (unique in its provider; letters, digits, ``-``
and ``_``), any of the adapter's own settings — an HTTP provider's ``api_key_env``,
``base_url``, ``headers``, ``proxy``; a CLI provider's ``env`` (its logged-in
configuration: ``CLAUDE_CONFIG_DIR``, ``CODEX_HOME``, a Gemini home), ``command`` … —
laid over the provider's (a table such as ``headers`` or ``env`` is merged, the
account's keys winning), and its own profile figures (`ACCOUNT_PROFILE_KEYS`: ``lanes``,
``rpm``, ``tpm``, ``itpm``, ``otpm``, ``max_hold_s``, ``first_starts``) over the
provider's profile. The queue (``queue_max``, ``queue_timeout_s``) and the timeouts stay
the provider's: it keeps one queue. A provider without ``accounts`` is one account.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from relay.vocab.profile import ACCOUNT_PROFILE_KEYS, AccountConfig, Profile

from .structure import structure_table, unknown_key, validation_problems

__all__ = ["MAX_ACCOUNTS", "load_accounts"]

MAX_ACCOUNTS = 64
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")


def load_accounts(where: str, table: Any, rest: dict[str, Any], adapter: Any,
                  profile: Profile, problems: list[str]
                  ) -> tuple[AccountConfig, ...] | None:
    """The provider's accounts (``()`` without any); None after a problem (noted)."""
    if table is None:
        return ()
    if not isinstance(table, list) or not all(isinstance(t, dict) for t in table):
        problems.append(f"[{where}] accounts: must be an array of tables "
                        f"([[{where}.accounts]], each with a name)")
        return None
    if not 1 <= len(table) <= MAX_ACCOUNTS:
        problems.append(f"[{where}] accounts: give 1 to {MAX_ACCOUNTS} accounts, not "
                        f"{len(table)}")
        return None
    before = len(problems)
    accounts: list[AccountConfig] = []
    seen: set[str] = set()
    valid = ("name", *ACCOUNT_PROFILE_KEYS,
             *(f.name for f in attrs.fields(adapter.Settings)))
    for i, entry in enumerate(table):
        name = entry.get("name")
        here = f"{where}.accounts[{i}]"
        if not isinstance(name, str) or not _NAME.match(name):
            problems.append(f"[{here}] name: each account needs a name of letters, digits, "
                            "'-' and '_' (it names the account in the status, records "
                            "and metrics)")
            continue
        here = f'{where}.accounts."{name}"'
        if name in seen:
            problems.append(f"[{here}] name: two accounts of one provider share the name "
                            f"{name!r}")
            continue
        seen.add(name)
        account = _account(here, name, entry, valid, rest, adapter, profile, problems)
        if account is not None:
            accounts.append(account)
    if len(problems) > before:
        return None
    return tuple(accounts)


def _account(here: str, name: str, entry: dict[str, Any], valid: tuple[str, ...],
             rest: dict[str, Any], adapter: Any, profile: Profile, problems: list[str]
             ) -> AccountConfig | None:
    """One account: its settings over the provider's, its figures over its profile."""
    for key in entry:
        if key not in valid:
            problems.append(unknown_key(here, key, valid))
    figures = {k: entry[k] for k in ACCOUNT_PROFILE_KEYS if k in entry}
    layered = dict(rest)
    for key, value in entry.items():
        if key == "name" or key in ACCOUNT_PROFILE_KEYS or key not in valid:
            continue
        base = layered.get(key)
        layered[key] = ({**base, **value} if isinstance(base, dict)
                        and isinstance(value, dict) else value)
    settings = structure_table(layered, adapter.Settings, here, problems)
    if settings is None:
        return None
    for key, message in adapter.settings_problems(settings):
        problems.append(f"[{here}] {key}: {message}")
    with attrs.validators.disabled():
        mine = attrs.evolve(profile, **figures)
    invalid = validation_problems(mine, here)
    if invalid:
        problems.extend(invalid)
        return None
    return AccountConfig(name=name, settings=settings, profile=mine)
