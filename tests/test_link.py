"""The client link shared by threads: each caller sends on its own thread under the socket lock.

A real committer process; several threads submit at once, in bursts that fill the socket (the
outbox path), while the I/O thread receives. Every request gets exactly its own reply.
"""

from __future__ import annotations

import threading

from omnishm import protocol
from omnishm.client.link import CommitterLink

LAYOUT = protocol.Layout(num_blocks=8, block_size=4)


def test_callers_on_many_threads_each_get_their_own_replies(committer):
    link = CommitterLink(cache=committer.name, role=protocol.ROLE_READER, endpoint=committer.endpoint,
                         layout=LAYOUT)
    errors: list[str] = []
    answered = [0] * 6

    def round_trips(i: int) -> None:
        try:
            for _ in range(150):
                fut = link.submit(lambda rid: protocol.StatusRequest(rid=rid))
                reply = fut.result(timeout=30)
                if not isinstance(reply, protocol.StatusReply) or reply.rid != fut.rid:
                    errors.append(f"thread {i}: request {fut.rid} got {reply!r}")
                answered[i] += 1
        except Exception as exc:  # reported below, with the thread
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    def burst(i: int) -> None:
        try:
            # More than the socket's send high-water mark (1000) at once: some wait in the outbox.
            futs = [link.submit(lambda rid: protocol.StatusRequest(rid=rid)) for _ in range(1500)]
            for fut in futs:
                reply = fut.result(timeout=60)
                if reply.rid != fut.rid:
                    errors.append(f"burst {i}: request {fut.rid} got the reply of {reply.rid}")
            answered[i] += len(futs)
        except Exception as exc:  # reported below, with the thread
            errors.append(f"burst {i}: {type(exc).__name__}: {exc}")

    try:
        threads = [threading.Thread(target=round_trips, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=burst, args=(i,)) for i in (4, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller hung"
        assert errors == []
        assert answered == [150] * 4 + [1500] * 2
        assert link.dead is None and link.stats["committer_lost"] == 0
    finally:
        link.close()
