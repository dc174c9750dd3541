"""The committer copies rows as bytes and never loads torch.

torch cost a committer 2-4 s of CPU at every start on these 2-core machines (an autostart, a restart after a
crash, every test) and ~200 MiB of private memory per host. The dtype names on the wire are checked against
``protocol.DTYPE_ITEMSIZE``; the client maps the same names to torch dtypes (``client/segments.DTYPES``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnishm import protocol
from omnishm.client.segments import DTYPES

from helpers import Writer, bits

LAYOUT = protocol.Layout(num_blocks=4, block_size=4)


def test_the_committer_and_the_client_know_the_same_dtypes_with_the_same_sizes():
    assert list(protocol.DTYPE_ITEMSIZE) == list(DTYPES)
    for name, size in protocol.DTYPE_ITEMSIZE.items():
        assert torch.empty((), dtype=DTYPES[name]).element_size() == size, name


def test_a_committer_that_wrote_every_dtype_has_not_loaded_torch(committer_factory):
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, LAYOUT, staging_rows=8)
    try:
        gen = torch.Generator().manual_seed(3)
        entries, staged = [], {}
        for n, name in enumerate(protocol.DTYPE_ITEMSIZE):
            view = writer.open_key(f"k-{name}", name, 3)
            # Random bytes of every dtype (bool: 0 or 1), compared as bytes.
            high = 2 if name == "bool" else 256
            shape = (view.staging.shape[0], view.staging.shape[1] * protocol.DTYPE_ITEMSIZE[name])
            staged[name] = torch.randint(0, high, shape, generator=gen, dtype=torch.uint8).view(view.dtype)
            view.staging.copy_(staged[name])
            entries.append((f"k-{name}", 100 + n, writer.new_cv(1), 2, [5, 9, 0]))
        done = writer.step_write(1, entries)
        assert isinstance(done, protocol.StepDone) and done.reason == "", done
        for name, rows in staged.items():
            pool = writer.keys[f"k-{name}"].pool
            assert torch.equal(bits(pool[[5, 9, 0]]), bits(rows[2:5])), name
        maps = Path(f"/proc/{handle.proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the committer loaded torch"
    finally:
        writer.goodbye()
