"""A libzmq (pyzmq) peer for kvbandit's ZMTP tests, shaped like vLLM's
ZmqEventPublisher (vllm/distributed/kv_events.py): a PUB socket that binds
or connects, an in-memory buffer of what it published, and a ROUTER replay
socket that answers [identity, "", start_seq] with [identity, "", seq,
payload] for every buffered batch from start_seq on, then
[identity, "", -1 (8 bytes), ""].

Options (argv): --bind | --connect ENDPOINT, --xpub (report subscriptions),
--replay (bind a ROUTER), --hb-ivl/--hb-timeout/--hb-ttl MS.
Prints "pub ENDPOINT", "replay ENDPOINT", then "ready".
Commands on stdin, one per line, hex-encoded frames ("-" is an empty one):
  pub SEQ TOPIC PAYLOAD     publish [topic, seq (8 bytes BE), payload] and buffer it
  buffer SEQ TOPIC PAYLOAD  buffer only: a message the subscriber lost
  raw FRAME...              publish these frames as they are
  sync WORD                 print "sync WORD" (every command before it is done)
  quit
Reports on stdout: "sub HEX" (XPUB subscription messages), "replay START".
"""

import queue
import sys
import threading
from collections import deque

import zmq


def unhex(s):
    """Frames are hex; "-" is an empty frame."""
    return b"" if s == "-" else bytes.fromhex(s)


def main():
    args = sys.argv[1:]
    opts = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--bind", "--xpub", "--replay"):
            opts[a] = True
        else:
            opts[a] = args[i + 1]
            i += 1
        i += 1

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB if "--xpub" in opts else zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    for flag, opt in (("--hb-ivl", zmq.HEARTBEAT_IVL), ("--hb-timeout", zmq.HEARTBEAT_TIMEOUT), ("--hb-ttl", zmq.HEARTBEAT_TTL)):
        if flag in opts:
            pub.setsockopt(opt, int(opts[flag]))
    if "--bind" in opts:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        print("pub tcp://127.0.0.1:%d" % port, flush=True)
    else:
        pub.connect(opts["--connect"])
        print("pub " + opts["--connect"], flush=True)

    replay = None
    if "--replay" in opts:
        replay = ctx.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        port = replay.bind_to_random_port("tcp://127.0.0.1")
        print("replay tcp://127.0.0.1:%d" % port, flush=True)

    commands = queue.Queue()

    def read_stdin():
        for line in sys.stdin:
            commands.put(line.split())
        commands.put(["quit"])

    threading.Thread(target=read_stdin, daemon=True).start()
    print("ready", flush=True)

    buffer = deque(maxlen=10000)
    end_seq = (-1).to_bytes(8, "big", signed=True)
    poller = zmq.Poller()
    if replay is not None:
        poller.register(replay, zmq.POLLIN)
    if "--xpub" in opts:
        poller.register(pub, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll(10) if poller.sockets else []:
            if sock is pub:
                print("sub " + pub.recv().hex(), flush=True)
            elif sock is replay:
                # vLLM's _service_replay.
                frame = replay.recv_multipart()
                if len(frame) != 3:
                    print("bad-replay-request %d" % len(frame), flush=True)
                    continue
                client_id, _, start_seq_bytes = frame
                start_seq = int.from_bytes(start_seq_bytes, "big")
                print("replay %d" % start_seq, flush=True)
                for seq, buf in buffer:
                    if seq >= start_seq:
                        replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
                replay.send_multipart((client_id, b"", end_seq, b""))
        try:
            cmd = commands.get(timeout=0 if poller.sockets else 0.01)
        except queue.Empty:
            continue
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] in ("pub", "buffer"):
            seq = int(cmd[1])
            topic, payload = unhex(cmd[2]), unhex(cmd[3])
            if cmd[0] == "pub":
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            buffer.append((seq, payload))
        elif cmd[0] == "sync":
            print("sync " + cmd[1], flush=True)
        elif cmd[0] == "raw":
            pub.send_multipart([unhex(f) for f in cmd[1:]])
    pub.close(0)
    if replay is not None:
        replay.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
