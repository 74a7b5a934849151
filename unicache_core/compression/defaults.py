"""Every default number of the compression methods, defined once (docs/compression.md §2-§8).

Per-task numbers are dicts keyed by :data:`~unicache_core.kv.token_types.TASKS`. Settings a request can
change (the method objects of :mod:`unicache_core.compression.methods`, the nodes, the CLI, calibration) start from
these values; the methods read them where a paper fixes them.
"""

from __future__ import annotations

from ..kv.token_types import TokenType

# ---------------------------------------------------------------- memory targets and retention (§8.7, §8.9)

#: KV reduction the UniCache paper matches every method at, per task: 80% understanding and editing, 60%
#: text-to-image. A baseline without an explicit target keeps ``1 - DEFAULT_REDUCTION[task]``.
DEFAULT_REDUCTION: dict[str, float] = {"understanding": 0.8, "t2i": 0.6, "edit": 0.8}
#: UniCache's starting retention ``rho0`` per task: the paper's average retention ``1 - DEFAULT_REDUCTION``. The
#: paper starts text-to-image and editing at 0.5 and relies on their conditional attention mass decaying
#: to reach those averages; starting at the average itself holds the paper's reductions whatever the mass
#: does (our choice; ``rho=0.5`` gives the paper's start). It is also the budget ratio while no attention
#: statistics exist yet (§8.6) and the strength of a policy-table entry that names none.
RHO0: dict[str, float] = {task: round(1.0 - reduction, 6) for task, reduction in DEFAULT_REDUCTION.items()}
#: Lowest retention the schedule decays to, per task (understanding stays at its ``rho0``).
RHO_FLOOR: dict[str, float] = {"understanding": 0.2, "t2i": 0.35, "edit": 0.1}
#: Tasks whose retention stays ``rho0`` whatever the attention does.
FIXED_RHO_TASKS: frozenset[str] = frozenset({"understanding"})
#: Exponent of the schedule ``rho_j = clip(rho0 * (m_j / m0) ** gamma, floor, rho0)``.
RHO_GAMMA = 1.0
#: Whether the schedule decays in bits (error parity, docs/compression.md §11.5): ``rho_j = rho0 + log4(m_j / m0)``
#: bits' worth of retention, instead of the power law above.
RHO_DECAY_IN_BITS = True
#: Least relative fall of ``rho`` the schedule acts on (this project's hysteresis, docs/compression.md §8.7): a
#: chunk whose formula lands less than 5% below the ``rho`` in force (and above the floor) keeps it. A smaller fall
#: frees under 5% of the budget, fewer bytes than the re-layout of every store it touches is worth.
RHO_MIN_FALL = 0.05

# ---------------------------------------------------------------- statistics (§8.5)

#: Most queries one observed call scores keys with: the last ones of a text (its observation window), an evenly strided
#: subset of an image block's or of a denoising step's latents.
SCORE_QUERIES = 256
#: UniCache's own: fewer suffice for its choices (docs/compression.md §8.5), and its statistics are part of its time.
UNICACHE_SCORE_QUERIES = 64
#: The node's and the shipped workflows' ``score_queries`` meaning "the method's own default".
SCORE_QUERIES_OF_METHOD = 0
#: Layers per layer chunk (layer 0 alone) and steps per step chunk (step 0 alone).
LAYER_CHUNK_SIZE = 4
STEP_CHUNK_SIZE = 5
#: EMA decay of the chunked statistics for text-to-image and editing.
EMA_DECAY = 0.8
#: Understanding averages over a window of this many calls (decay ``1 - 1/16``), carried across chunks.
UNDERSTANDING_EMA_WINDOW = 16

# ---------------------------------------------------------------- routing (§8.4)

#: A segment whose K90 is at most this is concentrated (evicted); above it, diffuse (quantized).
DEFAULT_K90_THRESHOLD = 0.3
#: Share of a segment's attention mass K90 covers.
K90_COVERAGE = 0.9

# ---------------------------------------------------------------- eviction (§2-§5, §7)

#: Share of an eviction budget kept as the most recent rows (H2O with a dynamic budget, UniCache).
RECENT_FRACTION = 0.25
#: SnapKV / PyramidKV observation window (queries) and key-pooling kernel.
WINDOW = 64
SNAPKV_KERNEL = 5
#: PyramidKV's steepness ``beta`` of the per-layer budgets.
PYRAMID_BETA = 20.0
#: StreamingLLM's attention sinks: the first compressible rows always kept.
SINK_TOKENS = 4
#: VL-Cache's relative ThresholdFilter ``p``: an entry counts when >= p x its row maximum.
VLCACHE_THRESHOLD = 0.01
#: LOOK-M's share of the kept rows that are the prompt's most recent ones: its official scripts keep 10% of the
#: prompt as heavy hitters and 10% as the recent window (``hh_ratio = recent_ratio = 0.1``), half and half.
LOOKM_RECENT_FRACTION = 0.5
#: LOOK-M's merge of the evicted rows into the kept ones: pivotal merging, its official scripts' variant
#: (``text_prior_pivot_merge``; docs/compression.md §14).
LOOKM_MERGE = "pivot"
#: UniCache's merge of the rows it drops into the rows it keeps: each weighted by its attention mass
#: (docs/compression.md §11.17).
UNICACHE_MERGE = "mass"
#: What UniCache's bytes of an evicted type buy (docs/compression.md §11.19): ``speed``, the rows its budget holds at
#: full precision (the paper's eviction: fewer rows attended); ``memory``, every row at low bits where that loses less
#: (§11.16: every row attended).
UNICACHE_OBJECTIVES: tuple[str, ...] = ("speed", "memory")
UNICACHE_OBJECTIVE = "speed"
#: The token types whose dropped rows UniCache merges (a store pooling other types only drops): the instruction and
#: the source images' ViT rows, what understanding reads. A source-VAE row is the source's pixels at one place,
#: which an edit copies; it is dropped, never blended with another place's (docs/compression.md §11.17).
MERGED_TYPES: tuple[TokenType, ...] = (TokenType.INSTRUCTION, TokenType.SOURCE_VIT)

# ---------------------------------------------------------------- quantization (§6, §8.6)

#: Most rows a quantized segment keeps in full precision (its residual), and the largest share of its rows
#: the residual may hold. Within these caps the residual takes the bytes its budget leaves after every row
#: is quantized (docs/compression.md §11.2).
KIVI_RESIDUAL = 32
KIVI_RESIDUAL_SHARE = 0.5
#: UniCache fits each value row's quantization range by least squares instead of taking its min and max (same
#: bytes; docs/compression.md §11.10); the KIVI baseline keeps its paper's min-max.
FIT_VALUE_RANGES = True
#: Below the 2-bit floor UniCache may keep a quantized type's rows with 2-bit keys and values at this many bits instead
#: of dropping them, where the sensitivity model says it loses less (docs/compression.md §11.13); only with fitted
#: value ranges (a 1-bit min-max range loses more than the values themselves hold). 2: no fewer value bits.
VALUE_FLOOR_BITS = 2
#: The most compressed (bits, group) of UniCache's lookup: the floor of a quantized segment.
KIVI_FLOOR = (2, 128)
#: KIVI group sizes (key groups run over tokens, value groups over channels): the KIVI baseline's and the
#: paper table's geometry.
KIVI_GROUPS: tuple[int, ...] = (32, 64, 128)
#: The group sizes a calibrated UniCache table offers its lookup (docs/compression.md §11.2): KIVI's and two
#: finer ones. A segment shorter than 32 rows (a 19-token t2i prompt) then gets a key scale and zero per 8 rows
#: instead of one pair for all its rows. On the bundled model at t2i 75% this moved UniCache's step fidelity from level
#: with KIVI's (+0.32 +- 0.60 dB) to ahead of it (+1.04 +- 0.57 dB; docs/results/quality.json, same bytes).
UNICACHE_GROUPS: tuple[int, ...] = (8, 16, 32, 64, 128)
#: UniCache quantizes a layer's quantized types as one store while their budgets together cannot hold every
#: row at this many bits (or one type's budget is under its own 2-bit floor): below it only key groups are left
#: to share out, and one store pays for one set of them (docs/compression.md §11.7).
POOL_BELOW_BITS = 4

# ---------------------------------------------------------------- joint eviction + quantization (§11)

#: Budget levels (retained byte ratios of one type) the offline sensitivity grid measures, and the bit widths
#: it compares at each level (16 = rows kept at full precision, i.e. eviction).
JOINT_LEVELS: tuple[float, ...] = (0.5, 0.25, 0.12, 0.06)
JOINT_BITS: tuple[int, ...] = (16, 8, 4, 2)
