"""The error every layer raises for a mistake a user can fix, kept in a module of its own that imports nothing,
so the config, the trainers and the run-directory code can all raise it (``unialign.config.exit_on_user_error``
prints it as one line and exits 2)."""


class UserError(ValueError):
    """A mistake the user can fix (a setting, a file, a row): reported as one line, exit status 2."""
