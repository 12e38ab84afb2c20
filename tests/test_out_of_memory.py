"""Out of memory is an answer, not a crash: every allocation failure is classified as one (orin.memory.oom), the
engine releases the request's memory and raises orin.errors.OutOfMemoryError, the server answers 503 (or, in a
stream already sent, an error event; in a Realtime session, an `error` event) and goes on serving, /metrics counts
it, and a request as large is tried again only once more memory is free (orin.serve.admission.MemoryPolicy).

The failures are injected through the engine's fault hook (EngineConfig.fault_hook), which raises them from the
step's check inside the decode loop, and the board's free memory is a fake reading (EngineConfig.memory_reader).
"""

from __future__ import annotations

import threading
import weakref

import openai
import pytest
import realtime_kit as rt
import server_kit as kit
import torch

from orin.errors import BudgetError, ModelError, OutOfMemoryError
from orin.memory.oom import MemoryReading, allocation_failure, out_of_memory, read_memory, refused
from orin.memory.vmm_driver import DriverError
from orin.serve.admission import MIN_GROWTH, MemoryPolicy
from orin.serve.protocol import to_api_error

MiB, GiB = 1 << 20, 1 << 30
NVML_ASSERT = ('NVML_SUCCESS == r INTERNAL ASSERT FAILED at "/pytorch/c10/cuda/CUDACachingAllocator.cpp":838, '
               "please report a bug to PyTorch.")


# --------------------------------------------------------------------------- the classifier and the readings


@pytest.mark.parametrize(("exc", "allocation"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 61.37 "
                            "GiB of which 1.02 GiB is free."), 2 * GiB),
    (RuntimeError(NVML_ASSERT), None),
    (RuntimeError("CUDA driver error: out of memory"), None),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), None),
    (RuntimeError("NvMapMemAllocInternalTagged: 1075072515 error 12"), None),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), None),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"), 4 * GiB),
    (DriverError("cuMemCreate", 512 * MiB, "failed with CUDA driver error 2"), 512 * MiB),
    (MemoryError(), None),
])
def test_out_of_memory_every_allocation_failure_is_classified_as_one(exc, allocation):
    failure = allocation_failure(exc)
    assert failure is not None and failure.allocation == allocation
    assert failure.cause.startswith(type(exc).__name__) and "\n" not in failure.cause


def test_out_of_memory_a_wrapped_failure_counts_and_other_errors_do_not():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        except RuntimeError as exc:
            raise ModelError("loading talker failed") from exc
    except ModelError as wrapped:
        failure = allocation_failure(wrapped)
    assert failure is not None and failure.allocation == 20 * MiB
    for other in (RuntimeError("shape '[2, 3]' is invalid for input of size 5"), ValueError("out of memory"),
                  DriverError("cuMemMap", 1 << 20, "failed with CUDA driver error 1"),  # invalid value, not OOM
                  DriverError("cuMemAddressReserve", 1 << 40, "would pass the profile's reservation bound"),
                  BudgetError("cannot fit"), KeyError("x")):
        assert allocation_failure(other) is None, other


def test_out_of_memory_readings_come_from_meminfo_and_say_what_is_not_readable(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       64000000 kB\nMemAvailable:    2097152 kB\nNvMapMemFree:      49152 kB\n"
                    "NvMapMemUsed:   12582912 kB\nHugePages_Total:       0\n")
    reading = read_memory(None, str(path))
    assert reading == MemoryReading(None, None, 2 * GiB, 12 * GiB, 48 * MiB)
    assert reading.free == 2 * GiB
    assert "MemAvailable 2.00 GiB" in reading.describe() and "NvMap used 12.00 GiB" in reading.describe()
    plain = tmp_path / "plain"
    plain.write_text("MemTotal: 1000 kB\nMemAvailable: 1024 kB\n")  # a kernel without NvMap's lines
    assert "NvMap not readable" in read_memory(None, str(plain)).describe()
    nothing = read_memory(None, str(tmp_path / "absent"))
    assert nothing.free is None and "MemAvailable not readable" in nothing.describe()
    # the least of the device's and the kernel's figures: on a Jetson both draw on the same DRAM
    assert MemoryReading(device_free=3 * GiB, mem_available=2 * GiB).free == 2 * GiB


def test_out_of_memory_is_a_503_with_what_was_asked_and_free():
    failure = allocation_failure(RuntimeError(NVML_ASSERT))
    err = out_of_memory(failure, 300 * MiB, MemoryReading(mem_available=100 * MiB))
    assert isinstance(err, BudgetError) and err.tried and err.asked == 300 * MiB
    api = to_api_error(err)
    assert api.status == 503 and api.code == "out_of_memory" and api.type == "server_error"
    assert api.headers == {"Retry-After": "5"}
    body = api.body()["error"]
    assert body["memory"]["asked_bytes"] == 300 * MiB and body["memory"]["free_bytes"] == 100 * MiB
    assert "300.00 MiB" in body["message"] and "100.00 MiB free" in body["message"] and "NVML" in body["message"]
    assert "retry" in body["message"] and "ask for less" in body["message"]
    assert to_api_error(BudgetError("cannot fit")).status == 400  # the planner's refusal stays a 400


# --------------------------------------------------------------------------- the admission policy


class Board:
    """Fake readings of the board's free memory, and a clock."""

    def __init__(self, free: int = 8 * GiB):
        self.free = free
        self.now = 1000.0

    def read(self) -> MemoryReading:
        return MemoryReading(mem_available=self.free, nvmap_used=3 * GiB, nvmap_free=48 * MiB)


def _failed(asked: int, free: int, allocation: int | None) -> OutOfMemoryError:
    failure = allocation_failure(torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {allocation} bytes" if allocation else "CUDA out of memory."))
    return out_of_memory(failure, asked, MemoryReading(mem_available=free))


def test_out_of_memory_policy_refuses_a_same_size_retry_until_free_memory_grows():
    board = Board(free=100 * MiB)
    policy = MemoryPolicy(board.read, clock=lambda: board.now)
    policy.admit(GiB)  # nothing failed yet: anything runs
    policy.failed(_failed(asked=200 * MiB, free=100 * MiB, allocation=200 * MiB))
    assert policy.remembered == 200 * MiB
    board.now += 30
    policy.admit(199 * MiB)  # smaller than what failed: tried
    for asked in (200 * MiB, GiB):  # as large or larger: refused without running
        with pytest.raises(OutOfMemoryError) as caught:
            policy.admit(asked)
        assert not caught.value.tried and caught.value.asked == asked
        assert "30 s ago" in str(caught.value) and "not tried" in str(caught.value)
    board.free = 299 * MiB  # more than then, but not room for the 200 MiB that failed on top of it
    with pytest.raises(OutOfMemoryError):
        policy.admit(200 * MiB)
    board.free = 300 * MiB  # room for it: let through, and the record forgotten
    policy.admit(200 * MiB)
    assert policy.remembered is None
    board.free = 0
    policy.admit(GiB)


def test_out_of_memory_policy_needs_the_asked_bytes_and_growth_where_the_size_is_unknown():
    board = Board(free=10 * MiB)
    policy = MemoryPolicy(board.read)
    policy.failed(_failed(asked=100 * MiB, free=10 * MiB, allocation=None))
    board.free = 10 * MiB + MIN_GROWTH
    with pytest.raises(OutOfMemoryError):  # grown past what was free, but not to what the request asks
        policy.admit(100 * MiB)
    board.free = 100 * MiB
    policy.admit(100 * MiB)
    # a refusal is no failure: it records nothing
    policy.failed(refused(100 * MiB, 100 * MiB, 10 * MiB, 1.0, MemoryReading(mem_available=10 * MiB)))
    assert policy.remembered is None
    # where nothing free can be read, the request runs
    blind = MemoryPolicy(lambda: MemoryReading())
    blind.failed(_failed(asked=100 * MiB, free=10 * MiB, allocation=None))
    blind.admit(100 * MiB)


# --------------------------------------------------------------------------- end to end: a real server


class Fault:
    """The engine's fault hook: once armed, raises `error` at the first step's check with `after` tokens
    generated (inside the decode loop), once; keeps a weak reference to the thinker's KV cache it fails over."""

    def __init__(self):
        self.engine = None
        self.after: int | None = None
        self.error: BaseException | None = None
        self.calls = 0
        self.fired_at: int | None = None
        self.cache = None
        self.lock = threading.Lock()

    def arm(self, after: int, error: BaseException) -> None:
        self.after, self.error, self.fired_at = after, error, None

    def __call__(self, state) -> None:
        with self.lock:
            self.calls += 1
            if self.after is None or len(state.tokens) < self.after:
                return
            error, self.after, self.fired_at = self.error, None, len(state.tokens)
        self.cache = weakref.ref(self.engine.decoders.thinker.k_cache[0])
        raise error


@pytest.fixture(scope="module")
def oom_engine(quantized_dir):
    from orin.runtime.engine import Engine, EngineConfig

    board, fault = Board(), Fault()
    engine = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none",
                                 memory_reader=board.read, fault_hook=fault))
    fault.engine = engine
    yield engine, fault, board
    engine.close()


def test_out_of_memory_mid_stream_is_a_clean_error_and_the_next_request_succeeds(oom_engine, quantized_dir):
    engine, fault, board = oom_engine
    board.free = 8 * GiB
    srv = kit.start_server(engine, quantized_dir)
    try:
        client = kit.client(srv)
        common = dict(model=engine.model_name, messages=[{"role": "user", "content": "Count to three."}],
                      max_tokens=8)
        baseline = client.chat.completions.create(**common)
        held = engine.memory()
        assert held["allocated_bytes"] > held["resident_bytes"]  # the KV caches a request leaves for the next
        after = min(2, baseline.usage.completion_tokens)

        # a streamed request fails after `after` tokens: the client gets an error event, no hang, no traceback
        fault.arm(after, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a "
                                                "total capacity of 61.37 GiB of which 12.00 MiB is free."))
        board.free = 100 * MiB
        chunks = []
        with pytest.raises(openai.APIError) as caught:
            for ch in client.chat.completions.create(stream=True, **common):
                chunks.append(ch)
        err = caught.value
        assert not isinstance(err, openai.APIStatusError)  # an event of the stream, after its 200 went out
        assert chunks and chunks[0].choices[0].delta.role == "assistant" and fault.fired_at == after
        assert err.body["code"] == "out_of_memory" and err.body["type"] == "server_error"
        memory = err.body["memory"]
        assert memory["tried"] is True and memory["asked_bytes"] > 0
        assert memory["allocation_bytes"] == 64 * MiB and memory["free_bytes"] == 100 * MiB
        assert memory["nvmap_used_bytes"] == 3 * GiB
        assert "Tried to allocate 64.00 MiB" in err.message and "100.00 MiB free" in err.message
        assert "Traceback" not in err.message
        # its memory was released: the caches it failed over are gone, not kept alive by the error
        assert fault.cache() is None
        released = engine.memory()
        assert released["allocated_bytes"] == released["resident_bytes"]
        assert kit.metrics(srv)['orin_out_of_memory_total{when="running"}'] == 1

        # the same request again, with no more memory free: refused at once, nothing run
        calls = fault.calls
        status, headers, body = kit.http_request(srv, "POST", "/v1/chat/completions", common)
        assert status == 503 and headers["Retry-After"] == "5"
        assert body["error"]["code"] == "out_of_memory" and body["error"]["memory"]["tried"] is False
        assert "not tried" in body["error"]["message"] and fault.calls == calls
        assert kit.metrics(srv)['orin_out_of_memory_total{when="admission"}'] == 1

        # once the board has room again, the next request succeeds with the normal answer
        board.free = 8 * GiB
        again = client.chat.completions.create(**common)
        assert again.choices[0].message.content == baseline.choices[0].message.content
        assert again.usage == baseline.usage

        # a non-streamed request that fails (Tegra's NVML assert) gets a 503 with the figures
        fault.arm(after, RuntimeError(NVML_ASSERT))
        board.free = 50 * MiB
        status, headers, body = kit.http_request(srv, "POST", "/v1/chat/completions", common)
        assert status == 503 and headers["Retry-After"] == "5"
        error = body["error"]
        assert error["code"] == "out_of_memory" and error["memory"]["tried"] is True
        assert error["memory"]["free_bytes"] == 50 * MiB and error["memory"]["allocation_bytes"] is None
        assert "NVML_SUCCESS" in error["message"] and "50.00 MiB free" in error["message"]

        board.free = 8 * GiB
        last = client.chat.completions.create(**common)
        assert last.choices[0].message.content == baseline.choices[0].message.content
        s = kit.metrics(srv)
        assert s['orin_out_of_memory_total{when="running"}'] == 2
        assert s['orin_out_of_memory_total{when="admission"}'] == 1
        # answers, not failures: the server stays healthy (the watchdog counts none of them)
        assert srv.worker.failures == 0 and kit.http_request(srv, "GET", "/health")[0] == 200
    finally:
        srv.stop()


def test_out_of_memory_in_a_realtime_response_is_an_error_event_and_the_session_goes_on(oom_engine, quantized_dir):
    engine, fault, board = oom_engine
    board.free = 8 * GiB
    srv = kit.start_server(engine, quantized_dir)
    try:
        with rt.session(srv) as conn:
            rt.configure(conn, output_modalities=["text"], max_output_tokens=5,
                         audio={"input": {"turn_detection": None}})
            rt.text_item(conn, "Hello!")
            fault.arm(1, DriverError("cuMemCreate", 256 * MiB, "failed with CUDA driver error 2"))
            board.free = 100 * MiB
            seen: list = []
            conn.response.create()
            done = rt.until(conn, "response.done", seen, errors_ok=True)
            errors = [e for e in seen if e.type == "error"]
            assert len(errors) == 1 and errors[0].error.code == "out_of_memory"
            assert "256.00 MiB" in errors[0].error.message and "100.00 MiB free" in errors[0].error.message
            assert done.response.status == "failed"
            board.free = 8 * GiB
            done = rt.respond(conn)  # the same session answers the next response
            assert done.response.status in ("completed", "incomplete")  # incomplete: at max_output_tokens
            assert done.response.output[0].content[0].text
        s = rt.metrics(srv)
        assert s['orin_out_of_memory_total{when="running"}'] == 1
        assert s['orin_realtime_responses_total{status="failed"}'] == 1
    finally:
        srv.stop()
