"""Drives SGLang's own KV-event publisher (sglang/srt/disaggregation/kv_events.py, taken
unchanged from the sglang 0.5.23 wheel by scripts/fixtures.sh) for kvroute's tests, with the
commands of scripts/publisher_driver.py.

usage: sglang_publisher.py ENDPOINT REPLAY_ENDPOINT
"""
import sys
import time

from publisher_driver import drive
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def main() -> None:
    endpoint, replay = sys.argv[1:3]
    drive(
        new_publisher=lambda: ZmqEventPublisher(
            attn_dp_rank=0, endpoint=endpoint, replay_endpoint=replay, bind=True
        ),
        store=lambda c: BlockStored(
            block_hashes=c["hashes"],
            parent_block_hash=c.get("parent"),
            token_ids=c["tokens"],
            block_size=c.get("block_size", 16),
            lora_id=None,
            medium="GPU",
        ),
        remove=lambda hashes: BlockRemoved(block_hashes=hashes, medium="GPU"),
        clear=AllBlocksCleared,
        batch=lambda events: KVEventBatch(ts=time.time(), events=events),
    )


if __name__ == "__main__":
    main()
