"""The control-plane reference: a ROUTER that decodes each request and answers at once.

``python -m omnishm.bench.echo ENDPOINT``. Same socket type, same msgspec
decoding and reply encoding as the committer, but no validation and no copy:
what one Python process can do per message on this machine. A ``Goodbye``
ends it. Imports no torch, so it starts in a fraction of a second.
"""

from __future__ import annotations

import sys

import zmq

from omnishm import protocol as P


def main(endpoint: str) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(endpoint)
    try:
        while True:
            ident, payload = sock.recv_multipart(copy=True)
            msg = P.request_decoder.decode(payload)
            if isinstance(msg, P.StepWrite):
                reply = P.StepDone(rid=msg.rid, step=msg.step, done_tids=msg.tids)
            elif isinstance(msg, P.Goodbye):
                sock.send_multipart([ident, P.encode(P.Bye(rid=msg.rid))])
                return 0
            else:
                reply = P.Error(rid=msg.rid, code="echo", message="echo answers StepWrite only")
            sock.send_multipart([ident, P.encode(reply)])
    finally:
        sock.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
