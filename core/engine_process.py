"""EngineProcess: the engine core in a process of its own, as vLLM runs its engine core.

In one process the HTTP side (Hypercorn, Quart, Trio: pure Python, one SSE event per token) and
the engine thread share one interpreter lock: at 64 and more streams the engine spent much of
each step waiting for it while the event loop wrote events. Here the engine runs in a spawned
child with its own interpreter; the server keeps the same `Engine` interface (add, abort, one
dispatch per step into per-request channels), so handlers cannot tell the difference.

Wire: two one-way pipes carrying msgspec msgpack frames. Server -> engine: Add, Abort, Shutdown.
Engine -> server: Ready once the model is loaded (what the server needs to validate requests and
build prompts), then one Step per engine step (its outputs and statistics), or Died with the
reason. On the server side both pipes are non-blocking and served by the Trio thread itself: a
system task waits for the reply pipe to be readable and dispatches each Step as it is decoded;
commands are written at once, or by a task that waits for room when the pipe is full (the
engine reads commands only between steps). A child that exits or is killed shows up as end of
file on the reply pipe: every in-flight request then ends with an error, as when the engine
thread dies.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import signal
import struct
import traceback
from typing import Any

import msgspec
import trio

from core.config import EngineConfig
from core.engine import _SHUTDOWN, Engine, Hold
from core.request_check import check_request
from core.request import EngineRequest, RequestOutput
from core.stats import StepStats

log = logging.getLogger("weir.engine")


# ---- messages ----
class Add(msgspec.Struct, tag="add", gc=False):
    request: EngineRequest


class Abort(msgspec.Struct, tag="abort", gc=False):
    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown", gc=False):
    pass


class SetHold(msgspec.Struct, tag="hold", gc=False):
    """A test hook (core/engine.py Hold): the rule, or None to step freely again."""

    rule: Hold | None


class Ready(msgspec.Struct, tag="ready", gc=False):
    model_path: str
    served_names: list[str]
    max_model_len: int
    vocab_size: int
    num_free_blocks: int
    generation_defaults: dict[str, Any]
    num_blocks: int = 0
    kv_dtype: str = ""


class Step(msgspec.Struct, tag="step", gc=False):
    outputs: list[RequestOutput]
    stats: StepStats | None


class Died(msgspec.Struct, tag="died", gc=False):
    message: str


Command = Add | Abort | SetHold | Shutdown
Reply = Ready | Step | Died


# ---- the engine process ----
def _engine_main(config_bytes: bytes, commands, replies, log_level: int) -> None:
    """Entry point of the spawned process: load the model, then step until told to stop or the
    server goes away (end of file on the command pipe)."""
    # Ctrl-C reaches the whole process group, and systemd's default KillMode sends SIGTERM to
    # every process of the service: the server drains first, then sends Shutdown. The engine
    # still stops when the server goes away (end of file on the command pipe), or on SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(Command).decode
    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        from gpu import openmp  # the one place core/ reaches into gpu/: in the child only

        openmp.prepare(config)  # before torch is imported (gpu/openmp.py)
        from gpu.launch import load

        loaded = load(config)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which fails its startup
        log.error("loading failed\n%s", traceback.format_exc())
        replies.send_bytes(encode(Died(f"loading failed: {type(e).__name__}: {e}")))
        return
    core = loaded.core
    gc.freeze()  # start-up's objects out of the collector's reach (see server/app.py)
    replies.send_bytes(
        encode(
            Ready(
                str(loaded.model_path),
                loaded.served_names,
                loaded.max_model_len,
                core.runner.vocab_size,
                core.kv.num_free_blocks,
                loaded.generation_defaults,
                core.kv.num_blocks,
                loaded.kv_dtype,
            )
        )
    )

    hold: Hold | None = None

    def handle(cmd: Command) -> bool:
        nonlocal hold
        if isinstance(cmd, SetHold):
            hold = cmd.rule
        elif isinstance(cmd, Add):
            try:
                core.add(cmd.request)
            except ValueError as e:  # raced past the server-side check: fail just this request
                rid = cmd.request.request_id
                out = RequestOutput(
                    request_id=rid, finished=True, finish_reason="error", error=str(e)
                )
                replies.send_bytes(encode(Step([out], None)))
        elif isinstance(cmd, Abort):
            core.abort(cmd.request_id)
        else:
            return False
        return True

    try:
        while True:
            # Block only when idle (or held); otherwise take whatever has arrived and step.
            held = False
            if hold is not None:
                held, hold = hold.check(core)
            if (not core.has_work or held) and not handle(decode(commands.recv_bytes())):
                return
            while commands.poll():
                if not handle(decode(commands.recv_bytes())):
                    return
            if hold is not None:
                held, hold = hold.check(core)
                if held:
                    continue
            outputs = core.step()
            replies.send_bytes(encode(Step(outputs, core.take_stats())))
    except (EOFError, BrokenPipeError):
        return  # the server is gone: nobody is left to serve
    except BaseException as e:  # noqa: BLE001 - any death must reach every waiting client
        log.error("engine process died\n%s", traceback.format_exc())
        try:
            replies.send_bytes(encode(Died(f"engine died: {type(e).__name__}: {e}")))
        except OSError:
            pass
    finally:
        core.close()  # tensor-parallel workers stop with the engine


# ---- the server side ----
class EngineProcess(Engine):
    """The server-side handle: the same add/abort/channels as the in-process Engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = None
        self.info: Ready | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._closing = False
        self._outbox = bytearray()  # command frames the pipe has not taken yet
        self._flush_done: trio.Event | None = None  # set while a task waits for room to write
        self._encode = msgspec.msgpack.Encoder().encode
        self._init_trio_side(0)

    def launch(self) -> Ready:
        """Blocking (call it from a worker thread): spawn the engine process and wait until its
        model is loaded. Raises RuntimeError when loading fails or the process dies first."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        reply_read, reply_write = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_engine_main,
            args=(
                msgspec.msgpack.encode(self.config),
                cmd_read,
                reply_write,
                logging.getLogger().getEffectiveLevel(),
            ),
            name="weir-engine",
            daemon=True,  # never outlives the server
        )
        proc.start()
        self._proc = proc
        # Drop our copies of the child's ends, so its death reads as end of file here.
        cmd_read.close()
        reply_write.close()
        self._cmd, self._reply = cmd_write, reply_read
        # On any exit that skipped shutdown(), close the command pipe first: the engine ignores
        # SIGTERM, so multiprocessing's own exit hook (terminate, then join) would wait forever.
        atexit.register(self._stop_at_exit)
        try:
            msg = msgspec.msgpack.decode(self._reply.recv_bytes(), type=Reply)
        except EOFError:
            self._proc.join(timeout=5)
            raise RuntimeError(
                f"the engine process exited (code {self._proc.exitcode}) before loading"
            ) from None
        if isinstance(msg, Died):
            self._proc.join(timeout=5)
            raise RuntimeError(msg.message)
        if not isinstance(msg, Ready):
            raise RuntimeError(f"the engine process sent {type(msg).__name__} before Ready")
        self.info = msg
        self._last_stats = StepStats(num_free_blocks=msg.num_free_blocks)
        return msg

    # ---- Trio thread ----
    def start(self) -> None:
        """Read the engine's replies and write commands on the Trio thread itself: no reader or
        writer thread that would have to win the interpreter lock back from the busy event loop
        for every frame (with threads, at 64 streams the reader fell behind, the reply pipe
        filled and the engine spent 11% of its time blocked in write)."""
        if self.info is None:
            raise RuntimeError("launch() the engine process first")
        self._trio_token = trio.lowlevel.current_trio_token()
        os.set_blocking(self._reply.fileno(), False)
        os.set_blocking(self._cmd.fileno(), False)
        trio.lowlevel.spawn_system_task(self._read_replies, name="weir-engine-replies")

    @property
    def alive(self) -> bool:
        return (
            self._proc is not None
            and self._proc.is_alive()
            and self._replies_running
            and self.error is None
        )

    @property
    def _replies_running(self) -> bool:
        return self._trio_token is not None and not self.stopped

    def _check(self, req: EngineRequest) -> None:
        check_request(req, self.info.vocab_size, self.info.max_model_len, self.config.max_logprobs)

    def _submit(self, kind, arg) -> None:
        if kind is _SHUTDOWN:
            msg = Shutdown()
        elif kind == "add":
            msg = Add(arg)
        elif kind == "hold":
            msg = SetHold(arg)
        else:
            msg = Abort(arg)
        frame = self._encode(msg)
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
        # for every read, 15 µs against 1 µs for a step's few hundred bytes.
        space = bytearray(1 << 20)
        view = memoryview(space)
        decode = msgspec.msgpack.Decoder(Reply).decode
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
                    await trio.to_thread.run_sync(self._proc.join, 1)
                    raise RuntimeError(
                        f"the engine process exited unexpectedly (code {self._proc.exitcode})"
                    )
                buf += view[:n]
                for frame in _take_frames(buf):
                    msg = decode(frame)
                    if isinstance(msg, Died):
                        raise RuntimeError(msg.message)
                    if isinstance(msg, Step):
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
        if self._proc is None:
            return
        self._closing = True
        if self._replies_running:
            self._submit(_SHUTDOWN, None)
            done = self._flush_done
            if done is not None:  # the pipe was full: let it take the rest before joining
                with trio.move_on_after(5):
                    await done.wait()
        else:
            self._cmd.close()  # never started: end of file tells the engine to leave
        await trio.to_thread.run_sync(self._reap)

    def _reap(self) -> None:
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            log.warning("the engine process did not stop in 10 s: killing it")
            self._proc.kill()
            self._proc.join()
        atexit.unregister(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        self._closing = True
        self._cmd.close()  # end of file: the engine leaves its loop after the current step
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


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
