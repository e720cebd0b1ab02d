"""Drives vLLM's own KV-event publisher (vllm/distributed/kv_events.py, taken unchanged from
the vllm 0.33.0 wheel by scripts/fixtures.sh) for kvroute's tests.

usage: vllm_publisher.py ENDPOINT REPLAY_ENDPOINT DP_RANK
ENDPOINT and REPLAY_ENDPOINT are the base ones (tcp://*:PORT: the publisher binds); dp rank r
binds port + r, as vLLM does. Reads one JSON command per line on stdin and answers "ok" once
the publisher has sent it:
  {"op": "store", "hashes": [...], "parent": null, "tokens": [...], "block_size": 16}
  {"op": "remove", "hashes": [...]}
  {"op": "clear"}
  {"op": "drop_next"}   the next batch is lost on the wire (the publisher still keeps it for
                        replay): a stand-in for the network, not a change to the publisher
  {"op": "restart"}     a new publisher process: its sockets closed and bound again, its
                        sequence numbers from 0, its replay buffer empty
"""
import json
import sys
import time

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


class LossyWire:
    """Wraps the PUB socket: drops the next message when asked."""

    def __init__(self, socket):
        self.socket = socket
        self.drop_next = False

    def send_multipart(self, frames):
        if self.drop_next:
            self.drop_next = False
            return
        self.socket.send_multipart(frames)

    def close(self, linger=None):
        self.socket.close(linger=linger)


def start(endpoint, replay, dp_rank):
    publisher = ZmqEventPublisher(
        data_parallel_rank=dp_rank, endpoint=endpoint, replay_endpoint=replay
    )
    wire = LossyWire(publisher._pub)
    publisher._pub = wire
    return publisher, wire


def main() -> None:
    endpoint, replay, dp_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    publisher, wire = start(endpoint, replay, dp_rank)
    print("ok", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "store":
            event = BlockStored(
                block_hashes=command["hashes"],
                parent_block_hash=command.get("parent"),
                token_ids=command["tokens"],
                block_size=command.get("block_size", 16),
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        elif op == "remove":
            event = BlockRemoved(block_hashes=command["hashes"], medium="GPU")
        elif op == "clear":
            event = AllBlocksCleared()
        elif op == "drop_next":
            wire.drop_next = True
            print("ok", flush=True)
            continue
        elif op == "restart":
            publisher.shutdown()
            time.sleep(0.2)
            publisher, wire = start(endpoint, replay, dp_rank)
            print("ok", flush=True)
            continue
        else:
            raise ValueError(f"unknown op {op!r}")
        publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
        publisher._event_queue.join()
        print("ok", flush=True)


if __name__ == "__main__":
    main()
