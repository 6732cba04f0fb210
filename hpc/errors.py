"""Errors a user can cause: reported as one line naming the fix, with a non-zero exit."""


class UserError(Exception):
    """Bad input (override, resources, data, missing tool). Its message is the whole report."""

    exit_code = 2
