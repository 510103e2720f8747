"""Fixtures the server tests share: the official `openai` client of the module's `server`."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def client(server):
    return server.client()
