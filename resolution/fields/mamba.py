"""Server fields: hybrid linear-attention (mamba) models.

Names, defaults, choices and flag spellings follow SGLang 0.5.19, so launch
commands carry over; the help lines are our own.
"""

from flotilla.resolution.fields.spec import Deprecated, F

FIELDS = (
    F(
        'mamba_backend',
        'str',
        'triton',
        "Kernel backend for Mamba state-space operations",
        choices=('triton', 'flashinfer'),
    ),
    F(
        'mamba_ssm_dtype',
        'str',
        None,
        "Data type for Mamba SSM states in the cache; read from the model config when unset",
        choices=('float32', 'bfloat16', 'float16'),
    ),
    F(
        'mamba_max_states_per_path',
        'int',
        -1,
        "Maximum cached Mamba states kept along each radix tree path; -1 means no limit",
    ),
    F(
        'enable_mamba_cache_stochastic_rounding',
        'bool',
        False,
        "Applies stochastic rounding when writing FP16 Mamba SSM cache states",
    ),
    F(
        'mamba_cache_philox_rounds',
        'int',
        0,
        "Philox rounds for stochastic rounding of FP16 Mamba cache writes; 0 uses the kernel default",
    ),
    F(
        'mamba_radix_cache_strategy',
        'str',
        'auto',
        "Buffering strategy used by the Mamba radix cache",
        choices=('auto', 'no_buffer', 'extra_buffer', 'extra_buffer_lazy'),
        resolvable=True,
        deprecated=(Deprecated('--mamba-scheduler-strategy', check_choices=False),),
    ),
    F(
        'uses_mamba_radix_cache',
        'bool',
        False,
        "Derived internally from the model architecture: whether the hybrid Mamba radix cache is used",
        resolvable=True,
        cli=False,
    ),
    F(
        'mamba_track_interval',
        'int',
        256,
        "Number of decode steps between tracked Mamba state snapshots",
    ),
    F(
        'enable_int8_mamba_checkpoint',
        'bool',
        False,
        "Stores radix-cached linear attention states in INT8 to roughly double cached prefix capacity",
    ),
    F(
        'int8_mamba_ckpt_size',
        'int',
        None,
        "Number of INT8 Mamba checkpoint slots; defaults to twice the active Mamba pool size",
    ),
    F(
        'linear_attn_backend',
        'str',
        'triton',
        "Default kernel backend for linear attention layers in both prefill and decode",
        choices=('triton', 'cutedsl', 'flashinfer', 'flashkda', 'nvidia_kda', 'ptx_kda', 'helion', 'intel_xpu'),
    ),
    F(
        'linear_attn_decode_backend',
        'str',
        None,
        "Linear attention kernel used for decode; falls back to --linear-attn-backend when unset",
        choices=('triton', 'cutedsl', 'flashinfer', 'flashkda', 'nvidia_kda', 'ptx_kda', 'helion', 'intel_xpu'),
    ),
    F(
        'linear_attn_prefill_backend',
        'str',
        None,
        "Linear attention kernel used for prefill; falls back to --linear-attn-backend when unset",
        choices=('triton', 'cutedsl', 'flashinfer', 'flashkda', 'nvidia_kda', 'ptx_kda', 'helion', 'intel_xpu'),
    ),
    F(
        'linear_attn_verify_backend',
        'str',
        None,
        "Linear attention kernel for speculative verification; follows the decode backend when unset",
        choices=('triton', 'cutedsl', 'flashinfer', 'flashkda', 'nvidia_kda', 'ptx_kda', 'helion', 'intel_xpu', 'nv_cutedsl'),
    ),
    F(
        'enable_linear_replayssm',
        'bool',
        False,
        "Uses the buffered ReplaySSM decode kernel for linear attention to reduce memory traffic",
    ),
    F(
        'linear_replayssm_cache_len',
        'int',
        16,
        "Ring buffer length for ReplaySSM decode; the full state is written back every this many steps",
    ),
    F(
        'enable_linear_replayssm_spec',
        'bool',
        False,
        "Uses ReplaySSM for speculative verification of linear attention with chain drafts",
        deprecated=(Deprecated('--enable-gdn-replayssm-spec', True, False),),
    ),
)
