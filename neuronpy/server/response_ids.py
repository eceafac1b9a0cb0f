"""The ids the server gives stored responses (the Responses API's `resp_<32 hex digits>`):
made and recognized in one place. The Responses API names its responses and reads back only
files so named; the session listing hides the sessions so named, which hold a stored
response's KV. A leaf: it imports nothing of the server."""

from __future__ import annotations

import re
import uuid

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # a response's id, matched whole (fullmatch)


def new_response_id() -> str:
    """A fresh id for a response, of RESPONSE_ID's shape."""
    return f"resp_{uuid.uuid4().hex}"
