"""A store's segment file written a column at a time (``write_one_batch``): the Arrow IPC file
of one record batch that ``pyarrow.ipc.new_file(...).write_table`` writes for a table whose
columns are each one chunk, byte for byte, while only one column is ever one chunk in memory.

A segment is one record batch (``ArrowKeyedStateStore._write_arrow``: its columns map as
contiguous arrays), so a table of many chunks was made one chunk a column, all of it, before
the write: a rebuild held its whole state twice over at its end. The IPC format puts a record
batch's body column after column, and its metadata (the row count, each column's field nodes
and buffers: lengths, null counts, offsets in the body) ahead of it: each column is made one
chunk, serialized alone by Arrow (its field nodes and buffers, its body, exactly as Arrow
writes them inside a batch of all columns: each buffer padded on its own), appended to the
body and let go; the metadata, whose flatbuffer's layout the column count and types fix, is
Arrow's own for a one-row batch of the schema with the numbers put in, written in the place
kept for it ahead of the body, and the CRC-32 combined (the body's, after the metadata's).
"""

import struct
import zlib
from collections.abc import Callable

import pyarrow as pa
import pyarrow.ipc as ipc

__all__ = ["fixed_buffer_counts", "write_one_batch"]


def fixed_buffer_counts(schema: pa.Schema) -> bool:
    """Whether ``schema``'s types fix how many buffers a batch of it has (not so of view
    types: their data buffers vary), as ``write_one_batch`` needs."""
    return not any(_has_variadic_buffers(field.type) for field in schema)


def write_one_batch(file, schema: pa.Schema, num_rows: int,
                    column: Callable[[int], pa.Array]) -> int:
    """Write to ``file`` (a binary file, seekable, at its start) the Arrow IPC file of one
    record batch of ``schema`` and ``num_rows`` rows, whose ``i``-th column ``column(i)``
    gives (one array; asked once, in order, each dropped once written); returns the file's
    CRC-32. ``num_rows`` must not be 0, and ``schema`` of ``fixed_buffer_counts``."""
    if num_rows <= 0:
        raise ValueError(f"a segment written a column at a time needs rows, not {num_rows}")
    template = _Template(schema)
    file.write(template.head)
    file.write(bytes(len(template.message)))  # the metadata's place: written last
    nodes, buffers, body_length, body_checksum = [], [], 0, 0
    for i, field in enumerate(schema):
        array = column(i)
        if len(array) != num_rows or not array.type.equals(field.type):
            raise ValueError(f"column {field.name}: {len(array)} rows of {array.type}, "
                             f"expected {num_rows} of {field.type}")
        body = _ColumnBody(file, body_checksum)
        # Arrow's stream writer: its body's buffers go to the file as they are, no copy
        with ipc.new_stream(body, pa.schema([field])) as writer:
            writer.write_batch(pa.RecordBatch.from_arrays([array], schema=pa.schema([field])))
        del array
        nodes += body.nodes
        buffers += [(offset + body_length, length) for offset, length in body.buffers]
        body_length += body.length
        body_checksum = body.checksum
    tail = template.tail(body_length)
    file.write(tail)
    message = template.message_for(num_rows, nodes, buffers, body_length)
    file.seek(len(template.head))
    file.write(message)
    checksum = zlib.crc32(message, zlib.crc32(template.head))
    return zlib.crc32(tail, _crc32_combine(checksum, body_checksum, body_length))


class _Template:
    """Arrow's IPC file of a one-row batch of a schema (nulls): its bytes before the record
    batch's message (magic, schema), the message's metadata and the bytes after its body (end
    of stream, footer), and where in them the numbers that depend on the batch's rows are."""

    def __init__(self, schema: pa.Schema) -> None:
        if not fixed_buffer_counts(schema):
            raise ValueError(f"a batch of {schema} has no fixed number of buffers")
        one = pa.Table.from_arrays([pa.nulls(1, field.type) for field in schema], schema=schema)
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, schema) as writer:
            writer.write_table(one)
        data = sink.getvalue().to_pybytes()
        footer_length = struct.unpack_from("<i", data, len(data) - 10)[0]
        footer_start = len(data) - 10 - footer_length
        footer = _Table(data, footer_start + struct.unpack_from("<I", data, footer_start)[0])
        blocks = footer.vector(3)  # Footer.recordBatches: Block (offset, metadata, body)
        if blocks is None or struct.unpack_from("<I", data, blocks)[0] != 1:
            raise ValueError("Arrow wrote not one record batch")
        block = blocks + 4
        offset, metadata_length, body = struct.unpack_from("<qi4xq", data, block)
        self.head = data[:offset]
        self.message = bytearray(data[offset:offset + metadata_length])
        self._tail = bytearray(data[offset + metadata_length + body:])
        self._tail_body_length = block + 16 - (offset + metadata_length + body)
        # the message: continuation, length, flatbuffer (Message -> RecordBatch)
        message = _Table(self.message, 8 + struct.unpack_from("<I", self.message, 8)[0])
        header = message.table(2)
        self._body_length = message.field(3)
        self._length = header.field(0)
        self._nodes, self._buffers = header.vector(1), header.vector(2)
        if None in (self._body_length, self._length, self._nodes, self._buffers) \
                or header.field(3) is not None:
            raise ValueError("Arrow's record batch metadata is not of the expected form")

    def message_for(self, num_rows: int, nodes: list[tuple[int, int]],
                    buffers: list[tuple[int, int]], body_length: int) -> bytes:
        """The record batch's metadata with the batch's numbers."""
        message = bytearray(self.message)
        for at, entries in ((self._nodes, nodes), (self._buffers, buffers)):
            if struct.unpack_from("<I", message, at)[0] != len(entries):
                raise ValueError("the columns' field nodes or buffers do not fit the schema's")
            for i, entry in enumerate(entries):
                struct.pack_into("<qq", message, at + 4 + 16 * i, *entry)
        struct.pack_into("<q", message, self._length, num_rows)
        struct.pack_into("<q", message, self._body_length, body_length)
        return bytes(message)

    def tail(self, body_length: int) -> bytes:
        """The bytes after the body: the footer's block with the body's length."""
        tail = bytearray(self._tail)
        struct.pack_into("<q", tail, self._tail_body_length, body_length)
        return bytes(tail)


class _ColumnBody:
    """A binary file that Arrow's stream writer writes one record batch to: the messages'
    framing and metadata (the schema's, then the batch's) are kept and read (its field nodes,
    buffers and body length), the batch's body goes on to ``file``, its CRC-32 carried on
    from ``checksum``; the end of stream is dropped."""

    def __init__(self, file, checksum: int) -> None:
        self._file, self.checksum = file, checksum
        self._head = bytearray()
        self._left: int | None = None  # the body's bytes still to come, once the head is read
        self.nodes: list = []
        self.buffers: list = []
        self.length = 0
        self.closed = False

    def _head_end(self) -> tuple[int, bool]:
        """How long the head is known to be so far, and whether that is all of it."""
        if len(self._head) < 8:
            return 8, False
        schema_end = 8 + struct.unpack_from("<i", self._head, 4)[0]
        if len(self._head) < schema_end + 8:
            return schema_end + 8, False
        return schema_end + 8 + struct.unpack_from("<i", self._head, schema_end + 4)[0], True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        while len(view) and self._left is None:
            end, whole = self._head_end()
            take = end - len(self._head)
            self._head += view[:take]
            view = view[take:]
            if whole and len(self._head) == end:
                schema_end = 8 + struct.unpack_from("<i", self._head, 4)[0]
                self.nodes, self.buffers, _, self.length = _record_batch_entries(
                    bytes(self._head[schema_end + 8:]))
                self._left = self.length
        if len(view) and self._left:
            body = view[:self._left]
            self.checksum = zlib.crc32(body, self.checksum)
            self._file.write(body)
            self._left -= len(body)
        return written

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _Table:
    """A flatbuffer table in ``data`` at ``at``: where its fields are."""

    def __init__(self, data, at: int) -> None:
        self.data, self.at = data, at
        self._vtable = at - struct.unpack_from("<i", data, at)[0]

    def field(self, index: int) -> int | None:
        """The position of field ``index``'s value (None: absent, its default)."""
        size = struct.unpack_from("<H", self.data, self._vtable)[0]
        if 4 + 2 * index >= size:
            return None
        offset = struct.unpack_from("<H", self.data, self._vtable + 4 + 2 * index)[0]
        return self.at + offset if offset else None

    def _target(self, index: int) -> int | None:
        at = self.field(index)
        return None if at is None else at + struct.unpack_from("<I", self.data, at)[0]

    def table(self, index: int) -> "_Table":
        return _Table(self.data, self._target(index))

    def vector(self, index: int) -> int | None:
        """The position of vector field ``index`` (its length, then its elements)."""
        return self._target(index)


def _record_batch_entries(data: bytes) -> tuple[list, list, int, int]:
    """A record batch's field nodes (length, null count), buffers (offset, length), row count
    and body length, from its metadata (a Message flatbuffer)."""
    message = _Table(data, struct.unpack_from("<I", data, 0)[0])
    header = message.table(2)
    entries = []
    for index in (1, 2):
        at = header.vector(index)
        count = 0 if at is None else struct.unpack_from("<I", data, at)[0]
        entries.append([struct.unpack_from("<qq", data, at + 4 + 16 * i) for i in range(count)])

    def number(table: _Table, index: int) -> int:
        at = table.field(index)
        return 0 if at is None else struct.unpack_from("<q", data, at)[0]

    return entries[0], entries[1], number(header, 0), number(message, 3)


def _has_variadic_buffers(data_type: pa.DataType) -> bool:
    if data_type.id in (pa.string_view().id, pa.binary_view().id):
        return True
    return any(_has_variadic_buffers(data_type.field(i).type)
               for i in range(data_type.num_fields))


def _crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of two byte strings one after the other, from each one's and the second's
    length (zlib's ``crc32_combine``, which Python's zlib does not expose): the first's CRC
    carried over the second's length of zero bits, in GF(2)."""
    if second_length <= 0:
        return first

    def times(matrix: list[int], vector: int) -> int:
        total, i = 0, 0
        while vector:
            if vector & 1:
                total ^= matrix[i]
            vector >>= 1
            i += 1
        return total

    def square(matrix: list[int]) -> list[int]:
        return [times(matrix, row) for row in matrix]

    odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    even = square(odd)  # two zero bits
    odd = square(even)  # four
    while True:
        even = square(odd)  # a zero byte, then 4, 16, ... : the length's bits, low first
        if second_length & 1:
            first = times(even, first)
        second_length >>= 1
        if not second_length:
            break
        odd = square(even)
        if second_length & 1:
            first = times(odd, first)
        second_length >>= 1
        if not second_length:
            break
    return first ^ second
