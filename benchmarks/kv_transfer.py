"""KV transfer benchmark between two processes: ours (nixl, tcp) vs memcpy and a raw NIXL READ.

``bench_transfer()`` spawns a prefill process holding a random cache and one
sender per method, and acts as the decode side itself. One run, methods
interleaved, medians over ``reps``:

- ``memcpy``: ``copy_`` of the same bytes inside one process (the memory's rate);
- ``raw nixl``: one registered buffer of the same size READ with a prepared
  request, re-posted each rep (NIXL/UCX's own rate, no per-request work);
- ``raw socket``: the same bytes ``sendall`` / ``recv_into`` over one fresh
  loopback connection (the rate tcp can reach);
- ``nixl`` / ``tcp``: ``receiver.start(handle)`` to DONE, for the request's
  blocks ``contiguous`` (fresh cache) and ``scattered`` (every other block: one
  descriptor / socket buffer per (layer, kv, block)), and ``scattered, block-major``
  with the cache stored ``[blocks, layers, 2, ...]`` (one run per block);
- ``+int8``: compressed; nixl's encode happens at ``offer`` (reported apart).

Target: ``nixl / raw nixl >= 0.8``. The caller sets the UCX
environment (``UCX_NET_DEVICES`` etc.) before calling; children inherit it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time

import torch

SMOLLM2 = {"num_layers": 30, "block_size": 16, "n_kv_heads": 3, "head_dim": 64}
_METHODS = {  # name -> (backend, compression, block pattern, cache storage)
    "nixl": ("nixl", "none", "contiguous", "layer"),
    "nixl scattered": ("nixl", "none", "scattered", "layer"),
    "nixl scat. b-major": ("nixl", "none", "scattered", "block"),
    "nixl+int8": ("nixl", "int8", "scattered", "layer"),
    "tcp": ("tcp", "none", "contiguous", "layer"),
    "tcp scattered": ("tcp", "none", "scattered", "layer"),
    "tcp scat. b-major": ("tcp", "none", "scattered", "block"),
    "tcp+int8": ("tcp", "int8", "scattered", "layer"),
}


def _cache(layout, num_blocks: int, storage: str, fill: bool):
    """A cache ``[L, 2, NB, ...]`` stored layer-major (the default) or block-major."""
    from compute.kv_transfer import KVPool

    if storage == "layer":
        t = torch.empty(layout.shape(num_blocks), dtype=layout.dtype)
    else:
        shape = layout.shape(num_blocks)
        t = torch.empty((shape[2], shape[0], shape[1], *shape[3:]), dtype=layout.dtype).permute(1, 2, 0, 3, 4, 5)
    t.copy_(torch.randn(t.shape)) if fill else t.zero_()
    return KVPool(layout, t)


def _serve_raw_socket(sock, buf: memoryview) -> None:
    while True:
        try:
            c, _ = sock.accept()
        except OSError:
            return
        with c:
            if c.recv(1):
                c.sendall(buf)


def _blocks(pattern: str, n: int) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(n)), list(range(n, 2 * n))
    return list(range(0, 2 * n, 2)), list(range(2 * n - 1, 0, -2))


def _prefill_side(conn, layout_dict: dict, num_blocks: int, raw_nbytes: int, methods: dict) -> None:
    import socket
    import threading

    from compute.kv_transfer import KVLayout, make_transfer
    from compute.kv_transfer.nixl import process_agent

    torch.set_num_threads(1)
    layout = KVLayout.from_dict(layout_dict)
    pools = {st: _cache(layout, num_blocks, st, True) for st in {m[3] for m in methods.values()}}
    made = {}
    for backend, comp, _, storage in methods.values():
        key = (backend, comp, storage)
        if key not in made:
            made[key] = make_transfer(backend, "prefill", layout, pools[storage], compression=comp, fallback=False,
                                      staging_blocks=max(num_blocks, 1), hold_s=60.0, timeout_s=20.0)  # fmt: skip
    agent = process_agent()
    raw = torch.randint(0, 255, (raw_nbytes,), dtype=torch.uint8)
    agent.register(raw)
    lsock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve_raw_socket, args=(lsock, memoryview(raw.numpy())), daemon=True).start()
    conn.send((agent.metadata(), raw.data_ptr(), lsock.getsockname()[1]))
    try:
        while conn.poll(120):
            msg = conn.recv()
            if msg[0] == "exit":
                break
            _, key, rid, blocks, ntok = msg
            t0 = time.perf_counter()
            h = made[tuple(key)].offer(rid, blocks, ntok)
            conn.send((h, time.perf_counter() - t0))
    finally:
        lsock.close()
        for s in made.values():
            s.close()


def _time_until_done(receiver, handle, dst) -> float:
    t0 = time.perf_counter()
    tid = receiver.start(handle, dst)
    while not (st := receiver.poll(tid)).terminal:
        time.sleep(5e-5)
    dt = time.perf_counter() - t0
    if st.value != "done":
        raise RuntimeError(f"transfer failed: {receiver.failure(tid)}")
    return dt


def _bench_layout(layout, num_tokens: int, reps: int, methods: dict) -> dict:
    import socket

    from compute.kv_transfer import make_transfer
    from compute.kv_transfer.nixl import process_agent

    n = layout.num_blocks_for(num_tokens)
    nbytes = n * layout.bytes_per_block
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_prefill_side, args=(child_conn, layout.to_dict(), 2 * n, nbytes, methods), daemon=True)
    proc.start()
    try:
        end = time.monotonic() + 120
        while not conn.poll(0.5):
            if not proc.is_alive() or time.monotonic() > end:
                raise RuntimeError("prefill process failed to start")
        md, raw_addr, raw_port = conn.recv()
        pools = {st: _cache(layout, 2 * n, st, False) for st in {m[3] for m in methods.values()}}
        receivers = {(b, st): make_transfer(b, "decode", layout, pools[st], fallback=False, timeout_s=20.0,
                                            hold_s=60.0)
                     for b, _, _, st in methods.values()}  # fmt: skip
        # raw NIXL: one buffer, one prepared READ, re-posted
        import numpy as np

        agent = process_agent()
        peer = agent.peer(md)
        raw_dst = torch.zeros(nbytes, dtype=torch.uint8)
        agent.register(raw_dst)
        x, dlists, _ = agent.read(peer, np.array([[raw_dst.data_ptr(), nbytes, 0]], dtype=np.uint64),
                                  np.array([[raw_addr, nbytes, 0]], dtype=np.uint64))  # fmt: skip
        while agent.state(x) == "PROC":
            pass

        def raw_read():
            t0 = time.perf_counter()
            with agent.lock:
                st = agent.agent.transfer(x)
                while st == "PROC":
                    st = agent.agent.check_xfer_state(x)
            if st != "DONE":
                raise RuntimeError("raw NIXL READ failed")
            return time.perf_counter() - t0

        a, b = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

        sock_dst = memoryview(raw_dst.numpy())

        def raw_socket():
            t0 = time.perf_counter()
            with socket.create_connection(("127.0.0.1", raw_port)) as c:
                c.sendall(b"x")
                got = 0
                while got < nbytes:
                    k = c.recv_into(sock_dst[got:])
                    if not k:
                        raise RuntimeError("raw socket closed early")
                    got += k
            return time.perf_counter() - t0

        def memcpy():
            t0 = time.perf_counter()
            b.copy_(a)
            return time.perf_counter() - t0

        times = {"memcpy": [], "raw nixl": [], "raw socket": [], **{m: [] for m in methods}}
        offer_s = {m: [] for m in methods}
        wire = {}
        for rep in range(reps + 1):  # rep 0 warms connections and caches
            sample = {"memcpy": memcpy(), "raw nixl": raw_read(), "raw socket": raw_socket()}
            for name, (backend, comp, pattern, storage) in methods.items():
                src, dstb = _blocks(pattern, n)
                conn.send(("offer", (backend, comp, storage), f"{name}-{rep}", src, num_tokens))
                handle, o = conn.recv()
                wire[name] = handle.wire_nbytes
                sample[name] = _time_until_done(receivers[(backend, storage)], handle, dstb)
                offer_s[name].append(o)
            if rep:
                for k, v in sample.items():
                    times[k].append(v)
        agent.release(x, *dlists)
        for r in receivers.values():
            r.close()
        rows = {}
        raw_s, sock_s = statistics.median(times["raw nixl"]), statistics.median(times["raw socket"])
        for name, ts in times.items():
            s = statistics.median(ts)
            rows[name] = {"bytes": nbytes, "wire_bytes": wire.get(name, nbytes), "seconds": s,
                          "gbps": nbytes / s / 1e9, "vs_raw_nixl": raw_s / s, "vs_raw_socket": sock_s / s}  # fmt: skip
            if name in offer_s:
                rows[name]["offer_seconds"] = statistics.median(offer_s[name][1:])
        return {"num_blocks": n, "nbytes": nbytes, "rows": rows}
    finally:
        try:
            conn.send(("exit",))
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def bench_transfer(num_tokens: int = 512, layout: dict | None = None, dtypes=("float32", "bfloat16"),
                   reps: int = 7, methods: dict | None = None, out: str | None = None,
                   echo: bool = True) -> dict:  # fmt: skip
    """Measure KV transfer of a ``num_tokens`` prompt (SmolLM2-135M layout by default).

    Returns (and writes to ``out`` as JSON) ``{"num_tokens", "target", "results": {dtype: {"nbytes",
    "rows": {method: {bytes, wire_bytes, seconds, gbps, vs_raw_nixl[, offer_seconds]}}}}, "meets_target"}``.
    """
    from compute.kv_transfer import KVLayout

    methods = dict(methods or _METHODS)
    result = {"num_tokens": num_tokens, "layout": dict(layout or SMOLLM2), "reps": reps, "target": 0.8,
              "results": {}}  # fmt: skip
    for dt in dtypes:
        lay = KVLayout(**(layout or SMOLLM2), dtype=dt)
        result["results"][dt] = _bench_layout(lay, num_tokens, reps, methods)
    result["meets_target"] = all(r["rows"]["nixl"]["vs_raw_nixl"] >= 0.8 for r in result["results"].values()
                                 if "nixl" in r["rows"])  # fmt: skip
    if echo:
        print(format_table(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_table(result: dict) -> str:
    title = (f"KV transfer, {result['num_tokens']} tokens, median of {result['reps']} "
             f"(target: nixl >= {result['target']}x raw NIXL)")  # fmt: skip
    header = (f"{'dtype':<9} {'method':<19} {'MB':>6} {'wire MB':>7} {'ms':>7} {'GB/s':>6} "
              f"{'x raw nixl':>10} {'x raw sock':>10}")  # fmt: skip
    lines = [title, header]
    for dt, r in result["results"].items():
        for name, row in r["rows"].items():
            lines.append(f"{dt:<9} {name:<19} {row['bytes'] / 1e6:>6.2f} {row['wire_bytes'] / 1e6:>7.2f} "
                         f"{row['seconds'] * 1e3:>7.2f} {row['gbps']:>6.2f} {row['vs_raw_nixl']:>10.2f} "
                         f"{row['vs_raw_socket']:>10.2f}")  # fmt: skip
    return "\n".join(lines)
