"""The one error of admission: a request the service refuses, naming the field at fault. The
public server turns it into INVALID_ARGUMENT with this message."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the service refuses; str() is the whole message, starting with the field's path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
