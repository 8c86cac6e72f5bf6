"""Server fields: prefill/decode disaggregation.

Names, defaults, choices and flag spellings follow SGLang 0.5.19, so launch
commands carry over; the help lines are our own.
"""

from flotilla.resolution.fields.spec import F

FIELDS = (
    F(
        'decoupled_spec_bind_endpoint',
        'str',
        None,
        "ZMQ endpoint this engine binds for incoming messages in decoupled speculative decoding",
    ),
    F(
        'decoupled_spec_connect_endpoints',
        'json_list',
        None,
        "Peer endpoints, ordered by peer rank, to connect to for decoupled speculative decoding",
    ),
    F(
        'decoupled_spec_rank',
        'int',
        None,
        "Rank of this engine within its verifier or drafter role in decoupled speculative decoding",
    ),
    F(
        'decoupled_spec_role',
        'str',
        'null',
        "Role in decoupled speculative decoding: verifier, drafter, or null to disable it",
        choices=('null', 'verifier', 'drafter'),
    ),
    F(
        'disaggregation_mode',
        'str',
        'null',
        "Role in prefill/decode disaggregation: prefill, decode, or null for a combined server",
        choices=('null', 'prefill', 'decode'),
    ),
    F(
        'disaggregation_transfer_backend',
        'str',
        'mooncake',
        "Transport used to move KV cache between prefill and decode servers",
        choices=('mooncake', 'nixl', 'ascend', 'fake', 'mori', 'mooncake_tcp'),
    ),
    F(
        'disaggregation_bootstrap_port',
        'int',
        8998,
        "Port of the bootstrap server that runs on the prefill server",
    ),
    F(
        'disaggregation_ib_device',
        'str',
        None,
        "InfiniBand device(s) for KV transfer: a name, a list, a per-GPU JSON map or a file; unset auto-detects",
    ),
    F(
        'disaggregation_decode_enable_radix_cache',
        'bool',
        False,
        "Turns on prefix caching on a disaggregated decode server to avoid resending KV",
    ),
    F(
        'disaggregation_decode_enable_offload_kvcache',
        'bool',
        False,
        "Offloads KV cache asynchronously on a disaggregated decode server",
    ),
    F(
        'disaggregation_decode_retraction_backup',
        'str',
        None,
        "Where KV of retracted decode requests is kept in disaggregation; unset infers from the KV pool",
        choices=('cpu_tensor', 'host_pool'),
    ),
    F(
        'num_reserved_decode_tokens',
        'int',
        512,
        "Decode tokens of memory reserved per request when it joins the running batch",
    ),
    F(
        'disaggregation_decode_extra_slots',
        'int',
        None,
        "Extra request slots preallocated on decode for requests still in transfer; unset picks a default",
    ),
    F(
        'disaggregation_decode_polling_interval',
        'int',
        1,
        "Iterations between request polls on the decode server; larger values cut overhead",
    ),
    F(
        'optimistic_prefill_attempts',
        'int',
        0,
        "Number of optimistic prefill passes allowed to run without waiting for bootstrap",
    ),
    F(
        'encoder_only',
        'bool',
        False,
        "Launches only the encoder part of a multimodal model as a standalone server",
    ),
    F(
        'language_only',
        'bool',
        False,
        "Loads only the language model weights of a vision-language model for encoder disaggregation",
    ),
    F(
        'language_model_only',
        'bool',
        False,
        "Never builds the multimodal encoder, freeing its memory; multimodal requests are rejected",
    ),
    F(
        'encoder_transfer_backend',
        'str',
        'auto',
        "Transport for encoder disaggregation; auto picks one based on the model and TP setup",
        choices=('auto', 'zmq_to_scheduler', 'zmq_to_tokenizer', 'mooncake'),
    ),
    F(
        'encoder_urls',
        'list_str',
        [],
        "URLs of the encoder servers to send multimodal work to",
        nargs='+',
    ),
    F(
        'encoder_bootstrap_port',
        'int',
        8997,
        "Port of the encoder registry server hosted by a language-only deployment",
    ),
    F(
        'encoder_register_urls',
        'list_str',
        [],
        "Encoder registry URLs an encoder-only server registers with at startup",
        nargs='+',
    ),
    F(
        'enable_adaptive_dispatch_to_encoder',
        'bool',
        False,
        "Sends multi-image requests to remote encoders and handles single-image ones locally",
    ),
    F(
        'enable_pdmux',
        'bool',
        False,
        "Turns on prefill/decode multiplexing on partitioned GPU streams",
    ),
    F(
        'pdmux_config_path',
        'str',
        None,
        "Path to the configuration file for prefill/decode multiplexing",
    ),
    F('sm_group_num', 'int', 8, "Number of streaming multiprocessor partition groups"),
)
