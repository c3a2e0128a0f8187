"""``record``: a read-only record type that costs what a plain one costs to build.

mypy holds a record's fields read-only, as a frozen dataclass's; at run time it is a plain
slots dataclass. A frozen dataclass sets each field through ``object.__setattr__`` (~1k
instructions a field), and a request builds ~14 records with ~110 fields: the decision's
(router/schedule/types.py), the request's, its salt's. ``dataclasses.replace`` makes a changed
copy."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

T = TypeVar("T")

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**_: Any) -> Any:  # typing's has frozen_default from 3.12 only
        return lambda decorator: decorator


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: type[T]) -> type[T]:
    return dataclasses.dataclass(slots=True)(cls)
