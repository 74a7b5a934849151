"""Offline K90 calibration of a UniCache policy table on a BAGEL checkpoint (docs/compression.md §8.4-§8.5).

Modules: :mod:`.options` (task names, :class:`CalibrationOptions`), :mod:`.inputs` (prompts file, image
folder, synthetic images), :mod:`.requests` (one request through the pipeline), :mod:`.run`
(:func:`calibrate`), :mod:`.aggregate`, :mod:`.sensitivity`, :mod:`.grid`, :mod:`.tables` (completing, checking and
writing tables), :mod:`.job` (:class:`CalibrationJob`: files in, table file out) and :mod:`.cli` (the command line,
``python -m unicache_core.bagel.calibrate``). Functions, not argv, are the interface::

    from unicache_core.bagel.calibration import CalibrationJob, CalibrationOptions, calibrate_job

    calibrate_job(CalibrationJob(checkpoint=Path("ckpt"), task="edit", prompts=Path("prompts.txt"),
                                 out=Path("ckpt/unicache_policy.json"), options=CalibrationOptions(num_timesteps=13)))

Procedure:

1. Every prompt (one per line of ``--prompts``, UTF-8, blank lines skipped) runs at full KV through
   :class:`~unicache_core.compression.calibration.CalibrationCacheFactory`, which scores every call where the
   cache is read (denoising steps of every CFG branch; understanding: the prompt prefill and every
   decoded token) on all layers, with 256 scored queries per call, and records, per (branch, layer,
   step, candidate type), the K90 of the type's per-key attention mass and the type's mass. Edit /
   understanding prompts are paired with the sorted images of ``--images`` round-robin; without
   ``--images`` they get deterministic synthetic images (coloured rectangles, ``--size`` px), and
   ``measurements`` says so.
2. Records are grouped with §8.5's chunking, per (type, layer chunk, step chunk) — understanding's
   prefill observation is its own step chunk ``"prefill"`` — and averaged per prompt inside each cell
   (over the cell's layers, steps and branches). The table's K90 of a (task, type) is the median of
   those per-(prompt, cell) values, routed with the 0.3 threshold
   (:meth:`~unicache_core.compression.policy_table.PolicyTable.from_k90`). ``measurements`` keeps, per cell,
   the median over prompts of the K90 and the mean mass, plus the per-branch medians.
3. ``--sensitivity``: for each candidate type present, every prompt runs again with only that type
   compressed, once evicted (H2O scores, 25% recent) and once quantized (the KIVI lookup row whose real
   bytes fit), at the task's target retention (0.2 understanding / edit, 0.4 t2i) — a UniCache run whose
   table protects the other types and whose rho is fixed at the ratio. The change against the
   calibration run (itself full KV) is the latent relative L2 (and 1 - cosine) for t2i / edit, and
   1 - token agreement for understanding. ``sensitivity_agrees[type]`` is True when the policy with
   the smaller change is the K90 choice; ``None`` on an exact tie or when the comparison is not at
   matched memory (``comparable`` False: a policy held the type above the ratio, e.g. a segment
   shorter than KIVI's 32-row residual cannot be quantized).
4. ``--grid``: the sensitivity grid of docs/compression.md §11.4. For each candidate type present, every prompt
   runs again with only that type compressed at each budget level (0.5, 0.25, 0.12, 0.06 of its bytes) x
   bits (full precision, 8, 4, 2), each bit width keeping the most rows that fit the level (matched
   bytes); the change is measured as for ``--sensitivity``. Per level the bit width with the least mean
   change wins (ties: fewer bits, more rows), and the type's entry becomes ``joint`` with that plan
   (``plan: [{"budget": level, "bits": b}, ...]``); ``measurements["grid"]`` keeps every point's change
   and the bytes the type held. The table also records the quantization geometry the grid used.

The table holds the calibrated entries of this task; the other (task, type) pairs keep the entries of
the ``--out`` table with ``--merge`` (a table of the same model; run once per task to build a full
table), else the paper's assignment (listed in ``measurements["filled"]``), so the file can be used
as ``<checkpoint>/unicache_policy.json`` for every task.
"""

from .aggregate import aggregate
from .grid import joint_grid
from .inputs import pair_inputs, read_images, read_prompts, synthetic_image
from .job import CalibrationJob, calibrate_job, check_job
from .options import SENSITIVITY_RATIO, TASK_NAMES, CalibrationOptions
from .run import calibrate
from .sensitivity import sensitivity, single_type_table, type_retained
from .tables import finish_table, write_table

__all__ = [
    "CalibrationJob",
    "CalibrationOptions",
    "SENSITIVITY_RATIO",
    "TASK_NAMES",
    "aggregate",
    "calibrate",
    "calibrate_job",
    "check_job",
    "finish_table",
    "joint_grid",
    "pair_inputs",
    "read_images",
    "read_prompts",
    "sensitivity",
    "single_type_table",
    "synthetic_image",
    "type_retained",
    "write_table",
]
