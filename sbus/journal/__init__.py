"""The recorder's journal: rotating, sealed segment files of bus messages.

`format` is the pure on-disk codec, `store` the directory (writer, recovery, readers),
`arrow` blocks as Arrow record batches, `export` sealed segments as Parquet and `tail`
the rows after them as Parquet pieces (for `sbus.spark.read_journal`), `read` the
readers behind ``sbus journal``, `retention` the pure deletion policy, `record` the
``sbus record`` command.
"""

from .format import Block, BlockInfo, FormatError
from .store import (
    JournalError,
    JournalWriter,
    Segment,
    list_segments,
    read_blocks,
    records,
    segment_blocks,
)

__all__ = ["Block", "BlockInfo", "FormatError", "JournalError", "JournalWriter", "Segment",
           "list_segments", "read_blocks", "records", "segment_blocks"]
