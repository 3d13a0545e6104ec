"""The base of every config model: immutable, and strict about unknown keys (a typo is an error,
not a silently ignored setting). Its own module so the config's parts can share it without
importing each other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
