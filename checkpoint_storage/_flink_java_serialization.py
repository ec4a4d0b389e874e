"""Java serialization (``ObjectOutputStream``) read as plain data, bounded: the grammar of the
``CheckpointProperties`` that end a Flink `_metadata` of format version 4 and later (objects of
serializable classes without custom ``writeObject``, strings, enums, null, back references).
Nothing runs code: no class is loaded and nothing is unpickled or deserialized into objects;
anything else is refused with ``FlinkMetadataError``, and nesting and the number of objects
are bounded, so hostile bytes end in that error, never in a crash or a huge allocation.

It reads through the `_metadata` parser's byte reader (``_flink_metadata._Reader``), whose
errors name the file and the offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from checkpoint_storage._flink_metadata import _Reader

_TC_NULL, _TC_REFERENCE, _TC_CLASSDESC, _TC_OBJECT, _TC_STRING = 0x70, 0x71, 0x72, 0x73, 0x74
_TC_ENDBLOCKDATA, _TC_ENUM = 0x78, 0x7E
_BASE_HANDLE = 0x7E0000
_SC_SERIALIZABLE, _SC_WRITE_METHOD = 0x02, 0x01
_PRIMITIVES = {"B": ">b", "C": ">H", "D": ">d", "F": ">f", "I": ">i", "J": ">q", "S": ">h"}
_MAX_JAVA_DEPTH = 16
_MAX_JAVA_HANDLES = 256


@dataclass
class _ClassDesc:
    name: str
    fields: list[tuple[str, str]]  # (type code, name)
    super_desc: _ClassDesc | None


@dataclass
class JavaObject:
    """A deserialized Java object as plain data: its class name and field values (primitive
    values, strings, enum constant names as ``JavaEnum``, nested ``JavaObject``)."""

    class_name: str
    fields: dict[str, object]


@dataclass(frozen=True)
class JavaEnum:
    class_name: str
    constant: str


def read_java_object(r: _Reader) -> object:
    """One object of a Java serialization stream (``ObjectOutputStream``) from ``r``: only
    the grammar ``CheckpointProperties`` uses (objects of serializable classes without
    custom ``writeObject``, strings, enums, null, back references); anything else is refused
    with ``FlinkMetadataError``."""
    if r.take(4, "checkpoint properties stream header") != b"\xac\xed\x00\x05":
        raise r.fail("the checkpoint properties do not start with a Java serialization header")
    handles: list[object] = []
    return _java_content(r, handles, 0)


def _new_handle(r: _Reader, handles: list, value: object) -> int:
    if len(handles) >= _MAX_JAVA_HANDLES:
        raise r.fail("the checkpoint properties hold too many objects")
    handles.append(value)
    return len(handles) - 1


def _java_content(r: _Reader, handles: list, depth: int) -> object:
    if depth > _MAX_JAVA_DEPTH:
        raise r.fail("the checkpoint properties nest too deeply")
    tc = r.u8("checkpoint properties type code")
    if tc == _TC_NULL:
        return None
    if tc == _TC_REFERENCE:
        index = r.i32("checkpoint properties back reference") - _BASE_HANDLE
        if not 0 <= index < len(handles) or handles[index] is None:
            raise r.fail(f"checkpoint properties back reference {index} is unknown")
        return handles[index]
    if tc == _TC_STRING:
        value = r.utf("checkpoint properties string")
        _new_handle(r, handles, value)
        return value
    if tc == _TC_CLASSDESC:
        r.pos -= 1
        return _java_class_desc(r, handles, depth)
    if tc == _TC_ENUM:
        desc = _java_class_desc(r, handles, depth + 1)
        slot = _new_handle(r, handles, None)
        constant = _java_content(r, handles, depth + 1)
        if not isinstance(desc, _ClassDesc) or not isinstance(constant, str):
            raise r.fail("a checkpoint properties enum has no class or constant name")
        handles[slot] = JavaEnum(desc.name, constant)
        return handles[slot]
    if tc == _TC_OBJECT:
        desc = _java_class_desc(r, handles, depth + 1)
        if not isinstance(desc, _ClassDesc):
            raise r.fail("a checkpoint properties object has no class")
        obj = JavaObject(desc.name, {})
        _new_handle(r, handles, obj)
        chain = []
        while desc is not None:
            chain.append(desc)
            desc = desc.super_desc
        for cls in reversed(chain):  # superclass data first, as Java writes it
            for type_code, name in cls.fields:
                if type_code == "Z":
                    obj.fields[name] = r.boolean(f"checkpoint properties field {name}")
                elif type_code in _PRIMITIVES:
                    fmt = _PRIMITIVES[type_code]
                    size = struct.calcsize(fmt)
                    obj.fields[name] = struct.unpack(fmt, r.take(size, name))[0]
                else:
                    obj.fields[name] = _java_content(r, handles, depth + 1)
        return obj
    raise r.fail(f"checkpoint properties hold Java type code {tc:#x}, which is not supported")


def _java_class_desc(r: _Reader, handles: list, depth: int) -> _ClassDesc | None:
    if depth > _MAX_JAVA_DEPTH:
        raise r.fail("the checkpoint properties nest too deeply")
    tc = r.u8("checkpoint properties class descriptor")
    if tc == _TC_NULL:
        return None
    if tc == _TC_REFERENCE:
        index = r.i32("checkpoint properties back reference") - _BASE_HANDLE
        if not 0 <= index < len(handles) or not isinstance(handles[index], _ClassDesc):
            raise r.fail(f"checkpoint properties class reference {index} is unknown")
        return handles[index]
    if tc != _TC_CLASSDESC:
        raise r.fail(f"expected a Java class descriptor, found type code {tc:#x}")
    name = r.utf("checkpoint properties class name")
    r.take(8, "serialVersionUID")
    flags = r.u8("class flags")
    if flags & _SC_WRITE_METHOD or not flags & _SC_SERIALIZABLE:
        raise r.fail(f"class {name} uses custom or external serialization, not supported")
    desc = _ClassDesc(name, [], None)
    _new_handle(r, handles, desc)
    n = struct.unpack(">H", r.take(2, "field count"))[0]
    for _ in range(n):
        type_code = chr(r.u8("field type code"))
        field_name = r.utf("field name")
        if type_code in ("L", "["):
            if not isinstance(_java_content(r, handles, depth + 1), str):
                raise r.fail(f"field {field_name} of {name} has no type name")
        elif type_code != "Z" and type_code not in _PRIMITIVES:
            raise r.fail(f"field {field_name} of {name} has unknown type code {type_code!r}")
        desc.fields.append((type_code, field_name))
    if r.u8("end of class annotations") != _TC_ENDBLOCKDATA:
        raise r.fail(f"class {name} carries annotations, not supported")
    desc.super_desc = _java_class_desc(r, handles, depth + 1)
    return desc
