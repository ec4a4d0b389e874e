"""State schema evolution across savepoints and checkpoints (Flink's state schema evolution):
which changes of a stage's state schema a restore accepts, and the conversion of state rows
written under the old schema into the new one. Pure Arrow: the same rules convert a DataFrame
stage's state files and each file of a keyed stage's chains as it is read.

Accepted: columns added (nullable: null; or with a default), columns dropped, types widened
(``widens``), columns renamed through an explicit mapping. Refused, naming the column and
both types: narrowing and other type changes, a NOT NULL column added without a default."""

from collections.abc import Mapping, Sequence

import pyarrow as pa

__all__ = ["check_evolution", "check_evolution_spec", "evolve_table", "integer_range", "widens"]


def check_evolution_spec(renamed: Mapping[str, str], defaults: Mapping[str, object],
                         schema: pa.Schema, key: Sequence[str], where: str) -> None:
    """Refuse a ``renamed`` mapping (old name -> new name) or ``defaults`` (new column ->
    value) that does not fit the state ``schema``: a rename into a column the schema lacks,
    from a name it still has, of a key column (a key change: refused on restore); a default
    of a column it lacks or that its type cannot hold."""
    if not isinstance(renamed, Mapping) or not isinstance(defaults, Mapping):
        raise TypeError(f"{where}: renamed and defaults must be mappings (old name -> new name; "
                        "column -> value)")
    for old, new in renamed.items():
        if new not in schema.names:
            raise ValueError(f"{where}: renamed {old!r} -> {new!r}, but {new!r} is not a state "
                             f"column ({schema.names})")
        if old in schema.names:
            raise ValueError(f"{where}: renamed {old!r} -> {new!r}, but {old!r} is still a "
                             "state column")
        if new in key:
            raise ValueError(f"{where}: renamed {old!r} -> {new!r}, a key column: a changed key "
                             "is not restored (write_savepoint a re-keyed table instead)")
    if len(set(renamed.values())) != len(renamed):
        raise ValueError(f"{where}: renamed maps two columns to one: {dict(renamed)}")
    for name, value in defaults.items():
        if name not in schema.names:
            raise ValueError(f"{where}: a default for {name!r}, which is not a state column "
                             f"({schema.names})")
        try:
            pa.array([value], schema.field(name).type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: default {value!r} of {name!r} is not a "
                             f"{schema.field(name).type}: {exc}") from exc


def widens(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether every value of type ``old`` is a value of type ``new`` unchanged: the same
    type; integers into integers holding all their values (int32 -> int64); floats into
    wider floats; decimals whose scale and integer digits do not shrink; string <->
    large_string and binary <-> large_binary (the same bytes)."""
    if old == new:
        return True
    if pa.types.is_integer(old) and pa.types.is_integer(new):
        low, high = integer_range(old)
        new_low, new_high = integer_range(new)
        return new_low <= low and high <= new_high
    if pa.types.is_floating(old) and pa.types.is_floating(new):
        return new.bit_width >= old.bit_width
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        return new.scale >= old.scale and new.precision - new.scale >= old.precision - old.scale
    for family in ((pa.types.is_string, pa.types.is_large_string),
                   (pa.types.is_binary, pa.types.is_large_binary)):
        if any(is_(old) for is_ in family) and any(is_(new) for is_ in family):
            return True
    return False


def integer_range(kind: pa.DataType) -> tuple[int, int]:
    """The smallest and largest value of an integer type."""
    bits = kind.bit_width
    if pa.types.is_signed_integer(kind):
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def _source_name(name: str, present: Sequence[str], renamed: Mapping[str, str]) -> str | None:
    """The column of a table with columns ``present`` that holds column ``name`` of the new
    schema: itself, else the old name ``renamed`` maps to it; None: a new column."""
    if name in present:
        return name
    old = next((o for o, n in renamed.items() if n == name), None)
    return old if old is not None and old in present else None


def check_evolution(stored: pa.Schema, target: pa.Schema, renamed: Mapping[str, str],
                    defaults: Mapping[str, object], where: str) -> list[str]:
    """The changes from state written with schema ``stored`` to state of schema ``target``
    (empty: none), as notes; a ValueError naming ``where``, the column and both types when a
    change cannot be restored, and what to do."""
    changes, problems = [], []
    used = set()
    for field in target:
        source = _source_name(field.name, stored.names, renamed)
        if source is None:
            if field.name in defaults:
                changes.append(f"added {field.name!r} (default {defaults[field.name]!r})")
            elif field.nullable:
                changes.append(f"added {field.name!r} (null)")
            else:
                problems.append(f"column {field.name!r} is new and NOT NULL, without a default: "
                                f"declare it nullable or give defaults={{{field.name!r}: ...}}")
            continue
        used.add(source)
        if source != field.name:
            changes.append(f"renamed {source!r} to {field.name!r}")
        old = stored.field(source).type
        if not widens(old, field.type):
            problems.append(
                f"column {field.name!r} was {old}, is now {field.type}: not a widening (only "
                "int -> wider int, float -> double, decimal with more digits, string <-> "
                "large_string, binary <-> large_binary restore)")
        elif old != field.type:
            changes.append(f"widened {field.name!r} from {old} to {field.type}")
    changes += [f"dropped {name!r}" for name in stored.names if name not in used]
    if problems:
        raise ValueError(
            f"{where}: the state cannot be restored into the new state schema: "
            + "; ".join(problems) + ". Keep the column's type (convert it in apply as the "
            "rows are read), or write a savepoint of the converted state with write_savepoint "
            "and start from it")
    return changes


def evolve_table(table: pa.Table, target: pa.Schema, renamed: Mapping[str, str],
                 defaults: Mapping[str, object], what: str) -> pa.Table:
    """``table`` (state rows written under an older schema, or the current one) as ``target``:
    renamed columns under their new names, new columns null or their default, dropped ones
    gone, widened ones cast. A ValueError naming ``what`` when a NOT NULL column has no
    source or a cast fails."""
    if table.schema.remove_metadata() == target.remove_metadata():
        return table
    columns = []
    for field in target:
        source = _source_name(field.name, table.column_names, renamed)
        if source is not None:
            column = table.column(source)
        elif field.name in defaults:
            column = pa.chunked_array([pa.array([defaults[field.name]] * table.num_rows,
                                                field.type)], field.type)
        elif field.nullable:
            column = pa.chunked_array([pa.nulls(table.num_rows, field.type)], field.type)
        else:
            raise ValueError(f"{what}: column {field.name!r} is missing and has no default "
                             f"(it has {table.column_names})")
        columns.append(column)
    try:
        return pa.Table.from_arrays(
            [c.cast(f.type) if c.type != f.type else c for c, f in zip(columns, target,
                                                                         strict=True)],
            schema=target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise ValueError(f"{what}: does not convert into {target}: {exc}") from exc
