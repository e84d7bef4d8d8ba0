"""The one named layer-range type: main layers [first, last) of a model, as a worker owns them,
a recipe places them and the tracker inputs report them (exo's `Shard` range, made strict)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LayerRange(BaseModel):
    """Main layers [first, last) of the model."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    first: int = Field(ge=0)
    last: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LayerRange:
        if self.first >= self.last:
            raise ValueError(f"first {self.first} must be below last {self.last}")
        return self

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """From the command line's FIRST:LAST."""
        first, sep, last = text.partition(":")
        if not sep or not first.strip().isdigit() or not last.strip().isdigit():
            raise ValueError(f"layer range {text!r} is not FIRST:LAST (half-open, e.g. 0:10)")
        return cls(first=int(first), last=int(last))

    @property
    def count(self) -> int:
        return self.last - self.first

    def __str__(self) -> str:
        return f"{self.first}:{self.last}"
