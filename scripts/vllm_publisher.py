"""Drives vLLM's own KV-event publisher (vllm/distributed/kv_events.py, taken unchanged from
the vllm 0.33.0 wheel by scripts/fixtures.sh) for kvroute's tests, with the commands of
scripts/publisher_driver.py.

usage: vllm_publisher.py ENDPOINT REPLAY_ENDPOINT DP_RANK [BUFFER_STEPS]
ENDPOINT and REPLAY_ENDPOINT are the base ones (tcp://*:PORT: the publisher binds); dp rank r
binds port + r, as vLLM does. BUFFER_STEPS: batches its replay buffer keeps (vLLM's default,
10,000, when not given).
"""
import sys
import time

from publisher_driver import drive
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def main() -> None:
    endpoint, replay, dp_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    buffer_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10_000
    drive(
        new_publisher=lambda: ZmqEventPublisher(
            data_parallel_rank=dp_rank,
            endpoint=endpoint,
            replay_endpoint=replay,
            buffer_steps=buffer_steps,
        ),
        store=lambda c: BlockStored(
            block_hashes=c["hashes"],
            parent_block_hash=c.get("parent"),
            token_ids=c["tokens"],
            block_size=c.get("block_size", 16),
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        remove=lambda hashes: BlockRemoved(block_hashes=hashes, medium="GPU"),
        clear=AllBlocksCleared,
        batch=lambda events: KVEventBatch(ts=time.time(), events=events),
    )


if __name__ == "__main__":
    main()
