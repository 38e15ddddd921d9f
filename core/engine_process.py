"""EngineProcess: the engine core in a process of its own, as vLLM runs its engine core.

In one process the HTTP side (Hypercorn, Quart, Trio: pure Python, one SSE event per token) and
the engine thread share one interpreter lock: at 64 and more streams the engine spent much of
each step waiting for it while the event loop wrote events. Here the engine runs in a child
(`python -m core.engine_process`, started as weir starts every child: core/child.py) with its own
interpreter, driven by the one engine loop (core/engine_loop.py); the server keeps the same
`Engine` front (add, abort, one dispatch per step into per-request channels), so handlers cannot
tell the difference.

Wire (core/engine_messages.py): two one-way pipes of msgspec msgpack frames. Server -> engine:
EngineInit, then AddRequest, AbortRequest, SetHold, Shutdown. Engine -> server: EngineReady once
the model is loaded, then one StepOutputs per engine step, or EngineDied with the reason. On the
server side both pipes are non-blocking and served by the Trio thread itself: a system task waits
for the reply pipe to be readable and dispatches each step as it is decoded; commands are written
at once, or by a task that waits for room when the pipe is full (the engine reads commands only
between steps). A child that exits or is killed shows up as end of file on the reply pipe: every
in-flight request then ends with an error, as when the engine thread dies.

With --api-server-count N > 1 the supervisor (server/supervisor.py) starts this process with
its own pair of pipes (EngineInit in, EngineReady out, then only Shutdown) followed by one pair
per API server on the command line; core/engine_fanout.py routes commands and outputs between
them, and each API server reaches the engine through core/engine_attached.py.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import struct
import subprocess
import sys
import traceback

import msgspec
import trio

from core.child import Child, exit_text, linked_pipes, pipes, watch_parent
from core.config import CheckpointError, EngineConfig, is_bad_input
from core.engine import Engine
from core.engine_fanout import Fanout
from core.engine_loop import EngineLoop
from core.engine_messages import (
    EngineCommand,
    EngineDied,
    EngineInit,
    EngineReady,
    EngineReply,
    Shutdown,
    StepOutputs,
)
from core.request import EngineRequest
from core.request_check import check_request
from core.stats import StepStats

log = logging.getLogger("weir.engine")


# ---- the engine process ----
def main() -> None:
    """`python -m core.engine_process CMD_FD REPLY_FD [CMD_FD REPLY_FD]...`: load the model,
    then step until told to stop or the server goes away (end of file on the command pipe, or
    the parent gone). More pairs: the API servers' (core/engine_fanout.py)."""
    # Ctrl-C reaches the whole process group, and systemd's default KillMode sends SIGTERM to
    # every process of the service: the server drains first, then sends Shutdown. The engine
    # still stops when the server goes away, or on SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent()
    commands, replies = pipes(sys.argv)
    servers = linked_pipes(sys.argv)
    fanout = Fanout((commands, replies), servers) if servers else None
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(EngineCommand).decode

    def tell(msg) -> None:
        """EngineReady or EngineDied: to the server, or to the supervisor and every API server."""
        if fanout is not None:
            fanout.send_all(msg)
        else:
            replies.send_bytes(encode(msg))

    try:
        init = decode(commands.recv_bytes())
    except EOFError:
        return
    if not isinstance(init, EngineInit):
        raise SystemExit(f"the engine process expected EngineInit, got {type(init).__name__}")
    logging.basicConfig(
        level=init.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        from gpu import openmp  # the one place core/ reaches into gpu/: in the child only

        openmp.prepare(init.config)  # before torch is imported (gpu/openmp.py)
        from gpu.launch import load

        loaded = load(init.config)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which fails its startup
        bad = is_bad_input(e)
        if bad:  # the model given: its message says it all
            log.error("loading failed: %s", e)
        else:
            log.error("loading failed\n%s", traceback.format_exc())
        tell(EngineDied(f"loading failed: {type(e).__name__}: {e}", bad))
        return
    core = loaded.core
    gc.freeze()  # start-up's objects out of the collector's reach (see server/engine_start.py)
    ready = EngineReady(
        str(loaded.model_path),
        loaded.served_names,
        loaded.max_model_len,
        core.runner.vocab_size,
        core.kv.num_free_blocks,
        loaded.generation_defaults,
        core.kv.num_blocks,
        loaded.kv_dtype,
        loaded.tokenizer_path,
        loaded.weight_bytes or {},
        loaded.kv_cache_bytes,
        loaded.device,
        loaded.lora_base,
        core.kv.block_size,
        sorted(core.eos_token_ids),
        loaded.labels,
        loaded.score_template,
        loaded.pooling,
    )

    def publish(outputs, stats) -> bool:
        replies.send_bytes(encode(StepOutputs(outputs, stats)))
        return True

    def take(block: bool):
        if not block and not commands.poll():
            return None
        return decode(commands.recv_bytes())

    tell(ready)
    if fanout is None:
        loop = EngineLoop(core, publish, refuse=lambda out: publish([out], None))
    else:
        loop = EngineLoop(core, fanout.publish, fanout.refuse)
        take = fanout.take
    try:
        loop.run(take)
    except (EOFError, BrokenPipeError):
        return  # the server is gone: nobody is left to serve
    except BaseException as e:  # noqa: BLE001 - any death must reach every waiting client
        log.error("engine process died\n%s", traceback.format_exc())
        try:
            tell(EngineDied(f"engine died: {type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        core.close()  # tensor-parallel workers stop with the engine


# ---- the server side ----
class EngineProcess(Engine):
    """The server-side front of the engine process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(0)
        self.config = config
        self.core = None
        self.info: EngineReady | None = None
        self._child: Child | None = None
        self._closing = False
        self._stop_loading = False  # kill_loading() was called: launch() must not go on
        self._outbox = bytearray()  # command frames the pipe has not taken yet
        self._flush_done: trio.Event | None = None  # set while a task waits for room to write
        self._encode = msgspec.msgpack.Encoder().encode

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child is not None else None

    def process_alive(self) -> bool:
        return self._child is not None and self._child.proc.poll() is None

    def launch(self) -> EngineReady:
        """Blocking (call it from a worker thread): start the engine process and wait until its
        model is loaded. Raises RuntimeError when loading fails or the process dies first."""
        if self._stop_loading:  # a signal came before the process was started
            raise RuntimeError("stopped before the engine process started")
        self._child = child = Child("core.engine_process")
        self._cmd, self._reply = child.commands, child.replies
        # On any exit that skipped shutdown(), close the command pipe first: the engine ignores
        # SIGTERM, and leaves on end of file.
        atexit.register(self._stop_at_exit)
        level = logging.getLogger().getEffectiveLevel()
        self._cmd.send_bytes(self._encode(EngineInit(self.config, level)))
        if self._stop_loading:  # a signal came while the process started
            self.kill_loading()
        return self._await_ready()

    def kill_loading(self) -> None:
        """Kill the engine process while it loads (launch() then raises): it has taken no
        request, and reads no command until its model is loaded. Called before the process
        is started (the server still importing), launch() raises when it comes to start it."""
        self._stop_loading = True
        if self._child is not None and self.info is None:
            self._closing = True
            self._child.proc.kill()
            self._child.proc.wait()  # at once after SIGKILL

    def _await_ready(self) -> EngineReady:
        """Blocking: the engine's first reply, EngineReady; raises when loading failed."""
        try:
            msg = msgspec.msgpack.decode(self._reply.recv_bytes(), type=EngineReply)
        except EOFError:
            code = self._wait(5)
            how = "" if code is None else f" ({exit_text(code)})"
            raise RuntimeError(f"the engine process exited{how} before loading") from None
        if isinstance(msg, EngineDied):
            self._wait(5)
            raise (CheckpointError if msg.bad_input else RuntimeError)(msg.message)
        if not isinstance(msg, EngineReady):
            raise RuntimeError(f"the engine process sent {type(msg).__name__} before EngineReady")
        self.info = msg
        self._last_stats = StepStats(num_free_blocks=msg.num_free_blocks)
        return msg

    def _wait(self, timeout: float) -> int | None:
        try:
            return self._child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    # ---- Trio thread ----
    def start(self) -> None:
        """Read the engine's replies and write commands on the Trio thread itself: no reader or
        writer thread that would have to win the interpreter lock back from the busy event loop
        for every frame (with threads, at 64 streams the reader fell behind, the reply pipe
        filled and the engine blocked in write; figures: docs/benchmarks.md)."""
        if self.info is None:
            raise RuntimeError("launch() the engine process first")
        self._trio_token = trio.lowlevel.current_trio_token()
        os.set_blocking(self._reply.fileno(), False)
        os.set_blocking(self._cmd.fileno(), False)
        trio.lowlevel.spawn_system_task(self._read_replies, name="weir-engine-replies")

    @property
    def alive(self) -> bool:
        return self.process_alive() and self._replies_running and self.error is None

    @property
    def _replies_running(self) -> bool:
        return self._trio_token is not None and not self.stopped

    def _check(self, req: EngineRequest) -> None:
        config = self.config
        check_request(
            req,
            self.info.vocab_size,
            self.info.max_model_len,
            config.max_logprobs,
            config.max_beam_width,
            config.max_num_seqs,
            (self.info.num_blocks, self.info.block_size),
            self.info.eos_token_ids,
        )

    def _submit(self, cmd) -> None:
        frame = self._encode(cmd)
        # multiprocessing.Connection's framing, which the engine reads with recv_bytes.
        self._outbox += struct.pack("!i", len(frame))
        self._outbox += frame
        self._flush()

    def _flush(self) -> None:
        """Write what the pipe takes now; if it is full, a task finishes once it drains."""
        if self._flush_done is not None or self._cmd.closed:
            return
        try:
            written = os.write(self._cmd.fileno(), self._outbox)
            del self._outbox[:written]
        except BlockingIOError:
            pass
        except OSError:
            self._outbox.clear()  # the engine is gone; the reply side reports it
            return
        if self._outbox:
            self._flush_done = trio.Event()
            trio.lowlevel.spawn_system_task(self._flush_later, name="weir-engine-commands")

    async def _flush_later(self) -> None:
        try:
            while self._outbox and not self._cmd.closed:
                await trio.lowlevel.wait_writable(self._cmd.fileno())
                try:
                    written = os.write(self._cmd.fileno(), self._outbox)
                    del self._outbox[:written]
                except BlockingIOError:
                    continue
        except (OSError, trio.ClosedResourceError):
            self._outbox.clear()  # the engine is gone; the reply side reports it
        finally:
            done, self._flush_done = self._flush_done, None
            done.set()

    async def _read_replies(self) -> None:
        fd = self._reply.fileno()
        buf = bytearray()
        # Read into one buffer made once: os.read(fd, 1 MiB) allocates (and maps) a fresh MiB
        # for every read, many times a step's few hundred bytes' cost.
        space = bytearray(1 << 20)
        view = memoryview(space)
        decode = msgspec.msgpack.Decoder(EngineReply).decode
        try:
            while True:
                await trio.lowlevel.wait_readable(fd)
                try:
                    n = os.readv(fd, [space])
                except BlockingIOError:
                    continue
                if not n:
                    if self._closing:
                        return
                    code = await trio.to_thread.run_sync(self._wait, 1)
                    # no code where this process is not its parent (an API server of several)
                    how = "" if code is None else f" ({exit_text(code)})"
                    raise RuntimeError(f"the engine process exited unexpectedly{how}")
                buf += view[:n]
                for frame in _take_frames(buf):
                    msg = decode(frame)
                    if isinstance(msg, EngineDied):
                        raise RuntimeError(msg.message)
                    if isinstance(msg, StepOutputs):
                        self._dispatch((msg.outputs, msg.stats))
        except trio.Cancelled:
            raise  # the Trio run is ending
        except Exception as e:  # noqa: BLE001 - a system task must not raise; the clients hear
            message = str(e)
            self.error = message if message.startswith("engine died") else f"engine died: {message}"
            log.error("%s", self.error)
            self._fail_all(self.error)
        finally:
            self.stopped = True

    async def shutdown(self) -> None:
        if self._child is None:
            return
        self._closing = True
        if self._replies_running:
            self._submit(Shutdown())
            done = self._flush_done
            if done is not None:  # the pipe was full: let it take the rest before joining
                with trio.move_on_after(5):
                    await done.wait()
        else:
            self._cmd.close()  # never started: end of file tells the engine to leave
        await trio.to_thread.run_sync(self._reap)

    def _reap(self) -> None:
        if self._wait(10) is None:
            log.warning("the engine process did not stop in 10 s: killing it")
            self._child.proc.kill()
            self._child.proc.wait()
        atexit.unregister(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        self._closing = True
        self._cmd.close()  # end of file: the engine leaves its loop after the current step
        if self._wait(5) is None:
            self._child.proc.kill()
            self._child.proc.wait()


def _take_frames(buf: bytearray) -> list[bytes]:
    """Remove and return the complete multiprocessing.Connection frames at the start of `buf`:
    a 4-byte big-endian length, or -1 then an 8-byte length for frames over 2 GiB."""
    frames = []
    pos = 0
    while True:
        if len(buf) - pos < 4:
            break
        (n,) = struct.unpack_from("!i", buf, pos)
        head = 4
        if n == -1:
            if len(buf) - pos < 12:
                break
            (n,) = struct.unpack_from("!Q", buf, pos + 4)
            head = 12
        if len(buf) - pos - head < n:
            break
        frames.append(bytes(buf[pos + head : pos + head + n]))
        pos += head + n
    del buf[:pos]
    return frames


if __name__ == "__main__":
    main()
