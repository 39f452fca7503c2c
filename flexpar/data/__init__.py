"""The data a device's virtual workers train on, for iterable (streaming) datasets.

`VirtualWorkerStreams` (streams.py; a group's reader in group_reader.py): one device's VW streams over an iterable
dataset, with their positions as plain data; `describe` (sources.py): what a
dataset is to the split (shards, state, passes) and what is refused. The split
and the pass-end rule are pure: flexpar/core/stream_split.py. The worker owns a
`VirtualWorkerStreams` where it owns a `VirtualWorkerLoader` for map-style data.
"""

from flexpar.data.group_reader import Restore
from flexpar.data.sources import StreamSource, describe, is_stream
from flexpar.data.streams import VirtualWorkerStreams

__all__ = ["Restore", "StreamSource", "VirtualWorkerStreams", "describe", "is_stream"]
