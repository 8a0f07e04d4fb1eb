"""The floor of moshpeer's data-plane architecture, for bench_allreduce.py (`--systems bare`).

A bare reduce-scatter + all-gather written the way moshpeer's data plane is (Python threads, one blocking TCP
connection per ordered pair of peers, fixed-size chunks, each frame tagged with moshpeer's `FrameAuth` MAC, a
finiteness check and torch adds; with `--compression int8` etc. instead, the codec's batched encode of a part and
its checked decode of each chunk) and nothing else: no matchmaking, handshake, loss handling, deadlines,
bookkeeping or reports. Its time against gloo's says what this architecture costs on the machine before any of
moshpeer's protocol; moshpeer's time against it says what the protocol adds.

Setup (untimed): a TCPStore at --master:--port carries each peer's listening address; a gloo process group on it
is the barrier before each round.
"""

from __future__ import annotations

import datetime
import hashlib
import resource
import socket
import struct
import threading
import time

FRAME = struct.Struct("!BHI17x")  # phase, part, chunk: 24 bytes like moshpeer's header
REDUCE, GATHER = 1, 2


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, 4 << 20)


def _pair_key(sender: int, receiver: int) -> bytes:
    return hashlib.blake2b(bytes([sender, receiver]), digest_size=32, person=b"bare-allreduce").digest()


def bare_worker(args, emit, error_check, peer_values) -> None:
    import torch
    import torch.distributed as dist

    from moshpeer.averaging.handshake import MAC_BYTES, FrameAuth
    from moshpeer.compression import get_compression

    rank, peers = args.rank, args.peers
    store = dist.TCPStore(args.master, args.port, peers, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=args.round_timeout * 2))
    server = socket.socket()
    server.bind((args.host, 0))
    server.listen(peers)
    store.set(f"bare{rank}", f"{args.host}:{server.getsockname()[1]}")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=peers)
    outbound = {}
    for j in range(peers):
        if j != rank:
            host, port = store.get(f"bare{j}").decode().rsplit(":", 1)
            sock = socket.create_connection((host, int(port)))
            sock.sendall(bytes([rank]))
            _tune(sock)
            outbound[j] = (sock, FrameAuth(_pair_key(rank, j)))
    inbound = {}
    for _ in range(peers - 1):
        sock, _ = server.accept()
        i = sock.recv(1)[0]
        _tune(sock)
        inbound[i] = (sock, FrameAuth(_pair_key(i, rank)))
    server.close()

    initial = peer_values(rank, args.numel)
    errors = error_check(peers, args.numel)
    tensor = initial.clone()
    bounds = [args.numel * k // peers for k in range(peers + 1)]
    chunk = max(1, args.chunk_bytes // 4)
    codec = None if args.compression == "none" else get_compression(args.compression).reduce_codec

    def chunks(part: int):
        return [(lo, min(lo + chunk, bounds[part + 1])) for lo in range(bounds[part], bounds[part + 1], chunk)]

    emit(event="ready", maddrs=[])
    full_err = None
    for round_index in range(args.rounds + 1):
        tensor.copy_(initial)
        mine = chunks(rank)
        total = torch.zeros(bounds[rank + 1] - bounds[rank])
        arrived, final, encoded = [0] * len(mine), [False] * len(mine), [None] * len(mine)
        cond = threading.Condition()
        dist.barrier()
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.monotonic()

        def send(j: int) -> None:
            sock, auth = outbound[j]
            contribution = None if codec is None else codec.encode_chunks(
                tensor[bounds[j]:bounds[j + 1]], chunk, [0] * len(chunks(j)))
            for phase, part, spans in ((REDUCE, j, chunks(j)), (GATHER, rank, mine)):
                for c, (lo, hi) in enumerate(spans):
                    if phase == GATHER:
                        with cond:
                            cond.wait_for(lambda: final[c])
                    if codec is None:
                        payload = tensor[lo:hi].view(torch.uint8).numpy()
                    elif phase == REDUCE:
                        payload = contribution.buffer[c, :contribution.nbytes[c]].numpy()
                    else:
                        payload = encoded[c].numpy()
                    header = FRAME.pack(phase, part, c)
                    sock.sendmsg([header, payload, auth.tag(header, payload)])

        def receive(i: int) -> None:
            sock, auth = inbound[i]
            stride = 4 * chunk if codec is None else codec.row_stride(chunk)
            inbox = torch.empty(stride, dtype=torch.uint8)
            header, mac = bytearray(FRAME.size), bytearray(MAC_BYTES)
            for phase, spans in ((REDUCE, mine), (GATHER, chunks(i))):
                for c, (lo, hi) in enumerate(spans):
                    nbytes = 4 * (hi - lo) if codec is None else codec.max_encoded_nbytes(hi - lo)
                    view = memoryview(inbox.numpy())[:nbytes]
                    _recv_exactly(sock, memoryview(header))
                    _recv_exactly(sock, view)
                    _recv_exactly(sock, memoryview(mac))
                    auth.check(header, view, mac)
                    part_lo = lo - bounds[rank]
                    if codec is not None:
                        if phase == GATHER:
                            _decode(inbox, nbytes, tensor[lo:hi], "into")
                            continue
                        with cond:
                            _decode(inbox, nbytes, total[part_lo:part_lo + hi - lo], "add")
                            _arrived(c, lo, hi, part_lo)
                        continue
                    values = inbox[:4 * (hi - lo)].view(torch.float32)
                    if not bool(torch.isfinite(values.sum())):
                        raise ValueError("non-finite values")
                    if phase == GATHER:
                        tensor[lo:hi].copy_(values)
                        continue
                    with cond:
                        total[part_lo:part_lo + hi - lo].add_(values)
                        _arrived(c, lo, hi, part_lo)

        def _decode(inbox, nbytes: int, out, mode: str) -> None:
            error = codec.decode_chunks(inbox.view(1, -1), [nbytes], out, out.numel(), [mode])[0]
            if error is not None:
                raise ValueError(error)

        def _arrived(c: int, lo: int, hi: int, part_lo: int) -> None:  # under cond
            arrived[c] += 1
            if arrived[c] == peers - 1:
                tensor[lo:hi].add_(total[part_lo:part_lo + hi - lo]).div_(peers)
                if codec is not None:
                    encoded[c] = codec.encode(tensor[lo:hi])
                final[c] = True
                cond.notify_all()

        failures = []

        def recording(work, peer: int) -> None:
            try:
                work(peer)
            except Exception as e:  # a floor that broke must not look fast
                failures.append(f"{work.__name__} {peer}: {e}")

        threads = [threading.Thread(target=recording, args=(send, j)) for j in outbound]
        threads += [threading.Thread(target=recording, args=(receive, i)) for i in inbound]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.round_timeout)
        finished = time.monotonic()
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        dist.barrier()  # the check below never runs beside another peer's timed round
        full_err = errors.full(tensor) if round_index == 0 else full_err
        ok = not failures and not any(t.is_alive() for t in threads)
        emit(event="round", round=round_index, ok=ok, seconds=finished - started, rel_err=errors.round(tensor),
             full_rel_err=full_err, bytes_sent=None, cpu_user_s=cpu_after.ru_utime - cpu_before.ru_utime,
             cpu_sys_s=cpu_after.ru_stime - cpu_before.ru_stime)
    emit(event="done")
    dist.destroy_process_group()
    for sock, _ in list(outbound.values()) + list(inbound.values()):
        sock.close()
