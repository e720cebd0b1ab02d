"""The command loop kvroute's tests drive an engine's own KV-event publisher with
(scripts/sglang_publisher.py, scripts/vllm_publisher.py give it their engine's classes).

Says "ok" once the publisher is bound, then reads one JSON command per line on stdin and
answers "ok" once the publisher has sent it:
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


def drive(new_publisher, store, remove, clear, batch):
    """Runs the command loop. `new_publisher()` makes a bound publisher; `store(command)`,
    `remove(hashes)` and `clear()` make the engine's events; `batch(events)` its batch."""

    def start():
        publisher = new_publisher()
        wire = LossyWire(publisher._pub)
        publisher._pub = wire
        return publisher, wire

    publisher, wire = start()
    print("ok", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "store":
            event = store(command)
        elif op == "remove":
            event = remove(command["hashes"])
        elif op == "clear":
            event = clear()
        elif op == "drop_next":
            wire.drop_next = True
            print("ok", flush=True)
            continue
        elif op == "restart":
            publisher.shutdown()
            time.sleep(0.2)
            publisher, wire = start()
            print("ok", flush=True)
            continue
        else:
            raise ValueError(f"unknown op {op!r}")
        publisher.publish(batch([event]))
        publisher._event_queue.join()
        print("ok", flush=True)
