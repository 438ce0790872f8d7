"""The error every layer raises for a mistake a user can fix, kept in a module of its own that imports nothing,
so the config, the trainers and the run-directory code can all raise it (``unialign.config.exit_on_user_error``
prints it as one line and exits 2)."""


class UserError(ValueError):
    """A mistake the user can fix (a setting, a file, a row): reported as one line, exit status 2."""


class MissingExtraError(UserError, ImportError):
    """An optional dependency (a ``pip install -e ".[extra]"``) a chosen feature needs is not installed: an
    ``ImportError`` to Python code, one line and exit status 2 from a script."""


def did_you_mean(value: object, options) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options`` to ``value`` (difflib's ratio >= 0.6), else ""."""
    import difflib

    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
