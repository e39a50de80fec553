"""A target actor's reads of the tokenized data: whole files kept in host memory while the schedule
is in their window (`schedule.Schedule`), so each file is read once an epoch, not once a sample."""

from __future__ import annotations

from collections import OrderedDict


class FileCache:
    """Rows of tokenized files, the `keep` most recently used files held (their `input_ids` and
    `loss_mask` columns); counts the files read and their bytes."""

    COLUMNS = ("input_ids", "loss_mask")

    def __init__(self, keep: int):
        self.keep = max(1, keep)
        self._tables: OrderedDict = OrderedDict()
        self.reads = 0
        self.bytes_read = 0
        self._taken = 0

    def row(self, uri: str, row: int) -> dict[str, list[int]]:
        table = self._tables.get(uri)
        if table is None:
            from dflash_ray.data.tokenized import read_table

            table = read_table(uri, list(self.COLUMNS))  # Parquet or Arrow
            self.reads += 1
            self.bytes_read += table.nbytes
            self._tables[uri] = table
            while len(self._tables) > self.keep:
                self._tables.popitem(last=False)
        self._tables.move_to_end(uri)
        return {k: table[k][row].as_py() for k in self.COLUMNS}

    def take_bytes(self) -> int:
        """Bytes read since the last call."""
        taken, self._taken = self.bytes_read - self._taken, self.bytes_read
        return taken
