"""``omnishm demo`` whose reader rank corrupts one element of each hidden row it serves (for tests/test_demo_edges.py).

Run as a file, so each spawned rank re-imports it as ``__mp_main__`` and takes the patch: the corruption
is in the rank processes of a real demo, with its real committer."""
import sys

import omnishm.demo.launch as launch
from omnishm.demo import rank as rank_mod

_real_run_rank = rank_mod.run_rank


def _run_rank(rank, opts, progress=None, barrier=None):
    if rank == 1:
        from omnishm.client import OmniPrefixCacheManager

        real = OmniPrefixCacheManager.materialize

        def corrupt(self, *a, **kw):
            out = real(self, *a, **kw)
            for r, t in list(out.hidden_states.items()):
                if t is not None and t.shape[0]:
                    t = t.clone()
                    t[0, 0] += 1
                    out.hidden_states[r] = t
            return out

        OmniPrefixCacheManager.materialize = corrupt
    return _real_run_rank(rank, opts, progress, barrier)


launch.run_rank = _run_rank

if __name__ == "__main__":
    from omnishm import cli

    sys.exit(cli.main(sys.argv[1:]))
