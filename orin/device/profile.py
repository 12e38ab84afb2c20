"""Device profiles: every tuning number and every capability the hot path branches on, in one frozen object per
kind of device, chosen once when the engine starts (orin.device.capabilities.detect) and passed down. Nothing on
the hot path reads a module-level tuning constant or probes the device per call; tests build a profile (or
`dataclasses.replace` one) instead of patching globals.

Four profiles: CPU, Hopper (sm_90: the H100/H200 the benchmarks run on), the AGX Orin (sm_87, the product's
target) and other Ampere GPUs (sm_8x). The numbers were measured on an H200 (docs/architecture.md says why each
is what it is); the Orin profile's are the same numbers until a board measures them, and `ORIN_NOTES` says, for
each, what carries it over (arithmetic or a public figure). `orin-omni plan` and `doctor` print the profile.

This module imports neither torch nor anything of the engine: `plan` uses it on a workstation for the Orin.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..errors import UsageError


@dataclass(frozen=True)
class Capabilities:
    """What this device and this build can run, probed once at start-up (orin.device.capabilities). A profile
    built without a device (`plan` on a workstation) assumes what its kind of device normally has."""

    cuda: bool = False
    # Triton compiles and orin's kernels pass their start-up check: the MoE's "triton" backend can be chosen.
    triton: bool = False
    # torch._grouped_mm runs here (sm_90+ in torch 2.8-2.11): a prompt's MoE runs one grouped GEMM a projection.
    grouped_mm: bool = False
    # aten's flash kernel masks a prefill chunk lower-right (a continued prompt's rows over a longer cache).
    flash_lower_right: bool = False
    # A long prompt's attention runs whole on cuDNN (Hopper and newer; twice flash-attention 2's rate there).
    cudnn_whole_prompt: bool = False
    # The device's memory is the host's (Tegra): pinned host memory and device memory count against one budget.
    unified_memory: bool = False


@dataclass(frozen=True)
class AttentionTuning:
    # A masked pass with at most this many query rows per KV head (a decode step, the code predictor's) uses the
    # few-rows attention (two GEMMs split over the keys); more rows (a continued prefill's) go through SDPA.
    small_query_rows: int = 64
    # Up to this many cache positions the few-rows attention stays SDPA's one fused kernel (the code
    # predictor's ~17 positions); past it SDPA's decode kernel walks the cache with 4 blocks and loses.
    few_rows_sdpa_max_keys: int = 256
    # A long prompt's whole-prompt attention pads its rows to a multiple of this, so prompts of nearby lengths
    # share cuDNN's per-shape plan (~80 ms to build, ~8 ms a layer to run at 25k tokens).
    whole_prompt_bucket: int = 1024


@dataclass(frozen=True)
class PrefillTuning:
    # Over this many prompt tokens (a video's) the prefill runs eagerly one layer at a time over the whole
    # prompt, its attention this many queries at a time: working memory is a chunk's, whatever the length.
    long_prefill_tokens: int = 4096
    # Token-expert rows a long prompt's MoE gathers at once: 4,096 tokens at the thinker's top-8. Fewer rows
    # doubled the blocks, whose launches leave the GPU idle after each layer's sync.
    long_moe_block_rows: int = 32768
    # The talker's user-turn projections run on blocks of this many rows; a long prompt's on the larger blocks
    # (64-row blocks were 1,200 launches and 50 ms of host time for a 25k-token video).
    projection_rows: int = 64
    long_projection_rows: int = 2048
    # The most patches one vision-encoder pass over a video takes (whole temporal grids): half as many patches
    # halve a pass's activations, the video request's peak; 8,192 are still a few large GEMMs a pass.
    video_encode_patches: int = 8192
    # Rows from which an eager Int4Linear runs dequantize + dense GEMM instead of tinygemm: the dequantizer's
    # ~40 us launch loses below 256 rows. Inside a CUDA graph only device time counts: from 64 rows.
    linear_dequant_min_rows: int = 256
    graph_dequant_min_rows: int = 64


@dataclass(frozen=True)
class MoeTuning:
    # Most bytes of INT4 experts a prompt's MoE holds dequantized at once where it runs dequantize + grouped GEMM.
    prefill_dequant_chunk: int = 64 << 20
    # The same for a long prompt: twice the bytes, half the pieces (each piece's launches follow a host sync).
    long_dequant_chunk: int = 128 << 20
    # A long prompt's MoE whose experts all dequantized fit this takes them at once, with no host sync a layer
    # (the talker's 128 experts: 288 MiB at real dimensions; the thinker's 1,152 MiB go in pieces).
    long_whole_experts_bytes: int = 320 << 20
    # Rows per expert (on average) from which a prompt runs one grouped GEMM a projection instead of tinygemm per
    # expert: at 1, a decode token still runs tinygemm, any real prompt the grouped GEMM.
    grouped_min_rows_per_expert: int = 1
    # Experts converted to the kernel layout per call when loading, about this many packed bytes a batch (the
    # load's transient memory twice over): 20 of the real thinker's experts; its read fits one staging buffer.
    load_batch_bytes: int = 48 << 20
    # Caps the experts of a load batch where set (tests use it to make many batches of the tiny model).
    load_batch_experts: int | None = None


@dataclass(frozen=True)
class CaptureTuning:
    # Captured prefill buckets kept per decoder, least recently used dropped first.
    prefill_graphs: int = 16
    # Deferred captures also cover the buckets of prompts this many tokens longer than the one just seen (a
    # conversation's next prompt is its last plus an answer and a question), or, where prompts have been
    # growing, one and a half times the last growth, at most `lookahead_max`.
    lookahead: int = 256
    lookahead_max: int = 2048
    # A prefill graph's capture runs its function once first (library handles, workspaces), not three times as a
    # decode step's does: at 2,000 rows each pass is a fifth of a second.
    capture_warmups: int = 1
    # A continued prefill replays a graph only where its mask has at most this many elements (SDPA turns it into
    # a bias kept in the graphs' pool): a voice turn's ~600 rows over a 3,072-position cache are 15.7M.
    after_mask_max: int = 1 << 25
    # A conversation's next turn reads its prompt's prefix from the cache: at least this many rows, or it is
    # prefilled whole.
    reuse_min_rows: int = 64
    # The most a prompt held for a next turn keeps alive between requests (embeddings, recorded hidden states,
    # deepstack features): inside the runtime margin, ~10,000 tokens of the real thinker.
    held_max_bytes: int = 128 << 20
    # Encoder graphs: captured shapes kept per engine, and shapes remembered as seen once (deferred captures).
    encoder_graphs: int = 8
    encoder_seen: int = 64
    # Off CUDA, prefills take the graph path all the same (padded to buckets, one "graph" per key, run eagerly,
    # captures deferred and wanted alike): the tests check on CPU the bookkeeping that CUDA replays.
    cpu_graph_path: bool = False


@dataclass(frozen=True)
class MemoryTuning:
    # Device memory a request needs beyond weights, KV caches and the largest live activations (graph pools,
    # cuBLAS workspaces, allocator slack): measured ~0.5 GiB above the estimate at real dimensions; the margin
    # keeps the budget a hard cap. The CPU engine counts tensors exactly and uses 0.
    runtime_margin: int = 768 << 20
    # A decoder's static KV cache holds a multiple of this many positions: growing it re-captures graphs, and a
    # conversation's context grows by a turn a response (96 MiB a granule at the thinker's widths).
    cache_granule: int = 1024
    # Pinned staging buffers (each loading thread keeps two, allocated once): the most one read-ahead holds.
    stage_bytes: int = 64 << 20
    # A span is read in pieces of this many bytes, `read_threads` at once.
    read_piece: int = 8 << 20
    read_threads: int = 4
    # Tensors closer than this in a file are read in one span (the bytes between them read and dropped).
    max_read_gap: int = 1 << 20
    # Rows converted at once on the CPU (bounds the int32 [rows, K] transient; a multiple of the 64-row block).
    cpu_convert_chunk_rows: int = 4096
    # The audio tokens of recent turns kept per engine (a conversation re-sends its earlier audio): ~100
    # six-second turns at the real encoder's width.
    audio_token_cache_bytes: int = 32 << 20
    # Addresses reserved for a swapped unit's weights (orin.memory.arena): its expected bytes times
    # `reserve_factor`, plus `reserve_slack`, so a unit that loads a little larger keeps its addresses (and its
    # graphs). Addresses cost nothing on a discrete GPU; Tegra refuses large reservations (below).
    reserve_factor: float = 2.0
    reserve_slack: int = 256 << 20
    # The most addresses one reservation may ask for (None: no limit); a unit needing more is given several.
    max_reservation_bytes: int | None = None
    # The most addresses all reservations together may hold beyond the memory budget (None: no limit); past it the
    # addresses of units swapped out are given back first, then a unit's weights come from its fallback pool.
    reserve_headroom_bytes: int | None = None
    # The largest single device allocation the runtime makes (None: no limit): physical memory mapped for weights,
    # KV caches, staging buffers and a long prompt's working memory come in pieces under it.
    max_allocation_bytes: int | None = None

    def cache_positions(self, n: int) -> int:
        """The positions a static KV cache that must hold `n` is given: a whole number of granules."""
        return -(-max(1, n) // self.cache_granule) * self.cache_granule


@dataclass(frozen=True)
class SpeechTuning:
    # Streaming code2wav: the first chunk is one frame, so the first audio waits for the talker's first frame;
    # each later chunk is as long as all before it, up to `code2wav_chunk` (a frame is 80 ms of audio and
    # 15-25 ms of talker steps, so each chunk is ready before the audio already out has played).
    code2wav_first_chunk: int = 1
    code2wav_chunk: int = 32
    # Frames of left context each chunk is decoded with, so the causal convolutions see a whole decode's history.
    code2wav_left_context: int = 25

    def chunk_frames(self, done: int) -> int:
        """The frames of the chunk after the first `done`: the first chunk's, then as many as all the chunks
        before it (1, 1, 2, 4, ... would wait twice for one frame: 1, 2, 4, 8, 16, 32, 32, ...), up to a whole
        chunk. Fixed by `done` alone, so a reply's chunks and their shapes never depend on timing, and a handful of
        shapes recur in every reply (each replayed from its own graph)."""
        if done == 0:
            return self.code2wav_first_chunk
        return min(self.code2wav_chunk, done + self.code2wav_first_chunk)

    def chunk_count(self, frames: int) -> int:
        """How many chunks code2wav decodes `frames` codec frames in."""
        done = chunks = 0
        while done < frames:
            done += self.chunk_frames(done)
            chunks += 1
        return chunks

    def every_shape_frames(self) -> int:
        """The fewest codec frames whose chunks meet every recurring shape: the growing chunks, then one frame of
        a whole one (padded to its shape as a last chunk). A warm-up that speaks this many leaves no shape for a
        client's reply to meet first (code2wav without graphs runs ~1,000 launches a chunk)."""
        done = 0
        while self.chunk_frames(done) < self.code2wav_chunk:
            done += self.chunk_frames(done)
        return done + 1


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # "cpu", "hopper", "orin", "ampere"
    description: str
    capabilities: Capabilities = field(default_factory=Capabilities)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    prefill: PrefillTuning = field(default_factory=PrefillTuning)
    moe: MoeTuning = field(default_factory=MoeTuning)
    capture: CaptureTuning = field(default_factory=CaptureTuning)
    memory: MemoryTuning = field(default_factory=MemoryTuning)
    speech: SpeechTuning = field(default_factory=SpeechTuning)
    # Streaming multiprocessors and SM clock, where known: the decode step's SM-bound time scales with these.
    sms: int | None = None
    sm_clock_ghz: float | None = None
    # The numbers in this profile that are assumptions, each with what carries it over (the Orin's).
    notes: tuple[tuple[str, str], ...] = ()

    @property
    def compute_dtype(self) -> str:
        """The engine's compute dtype (a torch dtype's name): BF16 on CUDA (the INT4 kernels take BF16), float32
        on the CPU. It sizes the BF16 weights, scales, KV caches and activations alike, so `plan` reads it too."""
        return "bfloat16" if self.capabilities.cuda else "float32"

    @property
    def compute_dtype_bytes(self) -> int:
        return 2 if self.capabilities.cuda else 4

    def with_capabilities(self, **found) -> DeviceProfile:
        return replace(self, capabilities=replace(self.capabilities, **found))

    def as_dict(self) -> dict:
        data = asdict(self)
        data["notes"] = dict(self.notes)
        return data

    def render(self) -> str:
        """The profile as `plan` and `doctor` print it: capabilities, then each tuning group's numbers."""
        caps = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in asdict(self.capabilities).items())
        lines = [f"device profile: {self.name} ({self.description})", f"  capabilities: {caps}"]
        if self.sms:
            lines.append(f"  SMs: {self.sms}" + (f" at {self.sm_clock_ghz} GHz" if self.sm_clock_ghz else ""))
        for group in ("attention", "prefill", "moe", "capture", "memory", "speech"):
            values = ", ".join(f"{k}={_number(k, v)}" for k, v in asdict(getattr(self, group)).items())
            lines.append(f"  {group}: {values}")
        for key, why in self.notes:
            lines.append(f"  assumed: {key}: {why}")
        return "\n".join(lines)


_BYTE_FIELDS = ("bytes", "chunk", "piece", "gap", "margin", "slack")  # fields that hold bytes (the rest: counts)


def _number(key: str, v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and key.endswith(_BYTE_FIELDS) and v % (1 << 20) == 0:
        return f"{v >> 20}MiB"
    return str(v)


CPU = DeviceProfile(
    name="cpu", description="CPU: eager torch ops, no graphs",
    memory=MemoryTuning(runtime_margin=0),
)

HOPPER = DeviceProfile(
    name="hopper", description="NVIDIA Hopper (sm_90): H100/H200, where the numbers were measured",
    capabilities=Capabilities(cuda=True, triton=True, grouped_mm=True, flash_lower_right=True,
                              cudnn_whole_prompt=True),
    sms=132, sm_clock_ghz=1.98,
)

AMPERE = DeviceProfile(
    name="ampere", description="NVIDIA Ampere (sm_8x) other than the Orin: Hopper's numbers, no cuDNN whole-prompt "
                               "attention and no grouped GEMM",
    capabilities=Capabilities(cuda=True, triton=True, flash_lower_right=True),
)

# Each Orin number that is carried over from the H200 rather than measured on a board, and why it carries.
ORIN_NOTES = (
    ("sms, sm_clock_ghz", "16 SMs at up to 1.3 GHz: NVIDIA's Jetson AGX Orin 64GB module data sheet (Ampere GPU, "
                          "2048 CUDA cores = 16 SMs x 128, max GPU frequency 1.3 GHz)"),
    ("memory.runtime_margin", "768 MiB as on the H200: the same graph pools and workspaces at the same widths; "
                              "unmeasured on a board"),
    ("memory.stage_bytes, read_piece, read_threads", "64 MiB / 8 MiB / 4: an NVMe read at the Orin's ~2-3 GB/s fills "
                                                     "a stage in ~25 ms, like the H200 host's at 14 GB/s in ~5 ms: "
                                                     "the pipeline stays two deep; 4 threads = 1 per 3 A78AE cores"),
    ("prefill.long_prefill_tokens", "4,096 as on the H200: a chunk's attention working memory (4,096 queries x 32 "
                                    "heads) is the same bytes on any device"),
    ("capture.*", "the H200's: graph captures bound host launch time, which the Orin's A78AE cores pay ~3x more "
                  "of (single-thread ~1/3 of the H200 host's Xeon), so every graph kept there helps at least as much"),
    ("moe.*", "the H200's byte bounds: they bound working memory, which is the same bytes on the Orin"),
    ("memory.max_reservation_bytes", "4 GiB: cuMemAddressReserve of 32 GiB fails on an AGX Orin 64 GB (JetPack 6) "
                                     "with 20-34 GB free while 8 GiB works (llama.cpp issue 29142; Orin Nano on "
                                     "JetPack 7.2: audio.cpp issue 12); half the largest size reported to work"),
    ("memory.reserve_factor, reserve_slack, reserve_headroom_bytes",
     "1.1 / 16 MiB / 4 GiB: a unit loads the same bytes each time, so 10% covers the first load's estimate; over the "
     "~74 units of the real model's 20 GiB that is ~3.2 GiB more addresses than weights, under the 4 GiB of headroom "
     "over the budget (room for one more reservation of the largest size allowed), where the H200's 2x + 256 MiB a "
     "unit was tens of GiB"),
    ("memory.max_allocation_bytes", "1 GiB: L4T 36.4.7+ (the NvMap fix for CVE-2025-33177) refuses large single "
                                    "cudaMallocs with NvMapMemAllocInternalTagged error 12 (llama.cpp PR 23732), at "
                                    "no published size; the model's largest tensor (the embedding, 594 MiB in BF16) "
                                    "fits under 1 GiB unsplit"),
    ("attention.few_rows_sdpa_max_keys", "256 as on the H200: SDPA's decode kernel walks the cache with one block per "
                                         "KV head on any GPU, and the Orin has 16 SMs to fill, fewer than the H200"),
)

ORIN = DeviceProfile(
    name="orin", description="NVIDIA Jetson AGX Orin 64GB (sm_87, 16 SMs, unified memory)",
    capabilities=Capabilities(cuda=True, triton=True, flash_lower_right=True, unified_memory=True),
    memory=MemoryTuning(reserve_factor=1.1, reserve_slack=16 << 20, max_reservation_bytes=4 << 30,
                        reserve_headroom_bytes=4 << 30, max_allocation_bytes=1 << 30),
    sms=16, sm_clock_ghz=1.3, notes=ORIN_NOTES,
)

PROFILES = {p.name: p for p in (CPU, HOPPER, ORIN, AMPERE)}


def named(name: str) -> DeviceProfile:
    """The profile called `name` (plan's --device-profile), or a UsageError listing the names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UsageError(f"device profile {name!r}: not one of {', '.join(PROFILES)}") from None


def for_arch(cuda: bool, capability: tuple[int, int] | None = None, tegra: bool = False) -> DeviceProfile:
    """The base profile of a device (before its capabilities are probed): the CPU; the Orin (sm_87, or any Tegra);
    Hopper and newer (sm_9x+); other Ampere-class GPUs."""
    if not cuda:
        return CPU
    if tegra or capability == (8, 7):
        return ORIN
    if capability is not None and capability[0] >= 9:
        return HOPPER
    return AMPERE
