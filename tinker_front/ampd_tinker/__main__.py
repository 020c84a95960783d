"""ampd-tinker --ampd=HOST:PORT --listen=HOST:PORT --models-dir=DIR --state-dir=DIR

Starts the front; prints "ampd-tinker: listening on HOST:PORT" once it
serves (port 0: a free one). --api-keys=FILE: one "API_KEY TENANT
[AMPD_TOKEN]" a line (# comments): only those keys, each key's models
owned by its tenant and created on ampd with the tenant's token; without
it any key starting tml- is accepted and owns what it creates.
"""
import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from ampd_tinker.engine import Engine
from ampd_tinker.keys import Keys, read_keys
from ampd_tinker.server import SDK_CONFIG, Front


def main(argv=None):
    p = argparse.ArgumentParser(prog="ampd-tinker", description=__doc__.split("\n")[0])
    p.add_argument("--ampd", required=True, help="the ampd server, HOST:PORT")
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve on")
    p.add_argument("--models-dir", required=True, help="Hugging Face folders, by base_model name")
    p.add_argument("--state-dir", required=True, help="checkpoints, futures journal, models")
    p.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    p.add_argument("--api-keys", help="API_KEY TENANT [AMPD_TOKEN] lines")
    p.add_argument("--ampd-token", default=os.environ.get("AMPD_TOKEN"),
                   help="ampd bearer token of keys without their own")
    p.add_argument("--max-samplers", type=int, default=4, help="sampler jobs kept (LRU)")
    p.add_argument("--max-models", type=int, default=64)
    p.add_argument("--max-body-bytes", type=int, default=64 << 20)
    p.add_argument("--max-pending", type=int, default=4096, help="unfinished futures")
    p.add_argument("--max-finished", type=int, default=16384, help="finished futures kept")
    p.add_argument("--gap-timeout", type=float, default=120.0,
                   help="seconds a model waits for a missing seq_id before skipping it")
    p.add_argument("--sdk-chunk-len", type=int, default=128,
                   help="datums per forward_backward request the SDK is told to send")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="ampd-tinker %(name)s %(levelname)s %(message)s")

    keys, tokens = read_keys(args.api_keys) if args.api_keys else (None, {})
    os.makedirs(args.state_dir, exist_ok=True)
    engine = Engine(args.ampd, args.models_dir, args.state_dir, args.precision,
                    tokens=tokens, max_samplers=args.max_samplers, max_models=args.max_models,
                    default_token=args.ampd_token)
    SDK_CONFIG["fwdbwd_max_chunk_len"] = max(1, args.sdk_chunk_len)
    front = Front(engine, Keys(keys), args.state_dir, max_body=args.max_body_bytes,
                  max_pending=args.max_pending, max_done=args.max_finished,
                  gap_timeout=args.gap_timeout)
    host, _, port = args.listen.rpartition(":")
    asyncio.run(_serve(front, host or "127.0.0.1", int(port)))


async def _serve(front, host, port):
    runner = web.AppRunner(front.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()
    print("ampd-tinker: listening on %s:%d" % (bound[0], bound[1]), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    front.pool.shutdown(wait=True)  # calls in flight finish (and journal) first


if __name__ == "__main__":
    sys.exit(main())
