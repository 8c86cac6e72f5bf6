"""Which tests show the effect of each honored server field (a non-default value changes
what the runtime does), for ``tests/resolution/test_runtime_support.py``.

Each entry is ``"tests/<path>.py::<test function>"`` (``::<Class>::<method>`` for a method);
the table test checks that every honored field has at least one and that each named test
exists. A change that flips a field to ``honored`` adds its test here in the same commit.
"""

EVIDENCE: dict[str, tuple[str, ...]] = {
    "abort_on_priority_when_disabled": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_priority_flags",
    ),
    "admin_api_key": (
        "tests/deploy/test_serve_tls_live.py::test_admin_route_needs_the_admin_key",
        "tests/serve/test_ingress_keys.py::test_admin_routes_need_the_admin_key_and_not_the_user_key",
        "tests/serve/test_ingress_keys.py::test_the_admin_key_alone_guards_only_the_admin_routes",
    ),
    "api_key": (
        "tests/serve/test_field_effects.py::test_api_key_makes_every_route_but_health_need_the_key",
        "tests/serve/test_ingress.py::test_api_key_health_and_metrics",
    ),
    "attention_backend": (
        "tests/cluster/engine/test_kernel_backends.py::test_cuda_kernel_names_run_on_flashinfer_in_half_precision",
        "tests/cluster/engine/test_kernel_backends.py::test_torch_attention_names_run_the_reference_on_cuda",
    ),
    "chat_template": (
        "tests/cluster/engine/test_llm_flags.py::test_chat_renders_with_the_chat_template_flag_and_its_default_kwargs",
        "tests/serve/test_field_effects.py::test_chat_template_is_the_template_the_ingress_renders_chats_with",
    ),
    "chunked_prefill_size": (
        "tests/cluster/engine/test_field_effects.py::test_chunked_prefill_size_splits_a_long_prompt_into_chunks_of_that_size",
        "tests/cluster/engine/test_llm.py::test_small_token_budget_chunks_prefill_and_still_equals_hf",
    ),
    "constrained_json_disable_any_whitespace": (
        "tests/cluster/engine/test_grammar.py::test_disable_any_whitespace_gives_canonical_json",
    ),
    "context_length": (
        "tests/cluster/engine/test_field_effects.py::test_context_length_bounds_a_request",
    ),
    "cuda_graph_bs_decode": (
        "tests/cluster/engine/test_kernel_backends.py::test_graph_sizes_follow_resolution_capped_at_the_running_requests",
    ),
    "cuda_graph_config": (
        "tests/cluster/engine/test_field_effects.py::test_cuda_graph_config_sets_the_decode_graph_sizes",
    ),
    "cuda_graph_max_bs_decode": (
        "tests/cluster/engine/test_kernel_backends.py::test_graph_sizes_follow_resolution_capped_at_the_running_requests",
        "tests/gpu/test_parallel_nccl.py::test_tp2_decode_graphs_replay_over_nccl_and_match_eager",
    ),
    "dcp_comm_backend": (
        "tests/cluster/models/test_field_effects.py::test_dcp_comm_backend_picks_the_merge_of_partial_attention",
        "tests/cluster/engine/test_llm_dcp.py::test_dcp2_greedy_matches_single_rank",
    ),
    "dcp_size": (
        "tests/cluster/engine/test_llm_dcp.py::test_dcp2_greedy_matches_single_rank",
        "tests/cluster/engine/test_llm_dcp.py::test_runner_reports_logical_blocks_and_per_rank_bytes_under_dcp",
    ),
    "decode_attention_backend": (
        "tests/cluster/engine/test_field_effects.py::test_split_attention_backend_fields_choose_the_attention_kernels",
        "tests/cluster/engine/test_kernel_backends.py::test_split_prefill_decode_fields_map_to_one_backend",
    ),
    "default_chat_template_kwargs": (
        "tests/cluster/engine/test_llm_flags.py::test_chat_renders_with_the_chat_template_flag_and_its_default_kwargs",
        "tests/serve/test_field_effects.py::test_default_chat_template_kwargs_are_what_every_request_starts_from",
    ),
    "default_priority_value": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_priority_flags",
    ),
    "device": (
        "tests/cluster/engine/test_field_effects.py::test_device_cpu_runs_an_engine_resolved_for_a_gpu_platform_on_the_cpu",
        "tests/cluster/engine/test_kernel_backends.py::test_cpu_always_runs_the_torch_references",
        "tests/gpu/test_e2e_greedy.py::test_llm_on_gpu_decodes_like_the_runner",
    ),
    "disable_cuda_graph": (
        "tests/cluster/engine/test_kernel_backends.py::test_disable_cuda_graph_turns_decode_graphs_off",
        "tests/gpu/test_parallel_nccl.py::test_tp2_decode_graphs_replay_over_nccl_and_match_eager",
    ),
    "disable_decode_cuda_graph": (
        "tests/cluster/engine/test_field_effects.py::test_disable_decode_cuda_graph_turns_decode_graphs_off",
    ),
    "disable_overlap_schedule": (
        "tests/cluster/engine/test_field_effects.py::test_disable_overlap_schedule_turns_overlap_scheduling_off",
        "tests/gpu/test_overlap_cuda.py::test_overlap_matches_the_serial_engine_in_bf16_with_graphs",
    ),
    "disable_priority_preemption": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_priority_preemption_flags",
        "tests/cluster/engine/test_schedule_policy.py::test_no_preemption_when_disabled_or_the_gap_is_within_the_threshold",
    ),
    "disable_radix_cache": (
        "tests/cluster/engine/test_field_effects.py::test_disable_radix_cache_serves_a_repeated_prompt_without_cached_tokens",
    ),
    "disaggregation_decode_enable_radix_cache": (
        "tests/serve/test_field_effects.py::test_disaggregation_decode_enable_radix_cache_keeps_the_decode_pools_prefix_cache",
        "tests/serve/test_pd_live.py::test_transfers_are_counted_and_a_shared_prefix_moves_fewer_bytes",
    ),
    "disaggregation_mode": (
        "tests/serve/test_pd_live.py::test_pd_greedy_answers_equal_the_colocated_deployment",
        "tests/serve/test_pd_live.py::test_transfers_are_counted_and_a_shared_prefix_moves_fewer_bytes",
        "tests/deploy/test_serve_cmd.py::test_each_pool_resolves_for_its_role",
    ),
    "dist_timeout": (
        "tests/cluster/engine/test_field_effects.py::test_dist_timeout_bounds_a_collective_waiting_for_a_stuck_rank",
    ),
    "dp_size": (
        "tests/serve/test_field_effects.py::test_dp_size_without_dp_attention_runs_that_many_engine_replicas",
        "tests/cluster/engine/test_llm_dp.py::test_dp_ranks_ran_in_lockstep_with_idle_steps",
    ),
    "dsa_decode_backend": (
        "tests/cluster/models/test_dsa_field_effects.py::test_the_cpu_platforms_torch_backends_build_the_dsa_layers_on_the_torch_ops",
        "tests/cluster/models/test_dsa_field_effects.py::test_a_cuda_dsa_kernel_under_cuda_attention_stops_the_start_naming_it",
        "tests/resolution/test_dsa_resolution.py::test_on_the_cpu_platform_dsa_resolves_to_the_torch_reference",
    ),
    "dsa_prefill_backend": (
        "tests/cluster/models/test_dsa_field_effects.py::test_the_cpu_platforms_torch_backends_build_the_dsa_layers_on_the_torch_ops",
        "tests/cluster/models/test_dsa_field_effects.py::test_a_cuda_dsa_kernel_under_cuda_attention_stops_the_start_naming_it",
        "tests/resolution/test_dsa_resolution.py::test_on_the_cpu_platform_dsa_resolves_to_the_torch_reference",
    ),
    "dsa_topk_backend": (
        "tests/cluster/models/test_dsa_field_effects.py::test_the_cpu_platforms_torch_backends_build_the_dsa_layers_on_the_torch_ops",
        "tests/cluster/models/test_dsa_field_effects.py::test_a_cuda_dsa_kernel_under_cuda_attention_stops_the_start_naming_it",
        "tests/resolution/test_dsa_resolution.py::test_an_explicit_top_k_backend_is_kept_on_the_cpu_platform",
    ),
    "dtype": (
        "tests/cluster/engine/test_field_effects.py::test_dtype_sets_the_weights_and_the_kv_cache",
        "tests/cluster/engine/test_kernel_backends.py::test_float32_runs_the_torch_references_on_cuda",
    ),
    "elastic_ep_backend": (
        "tests/cluster/engine/test_elastic_join.py::test_elastic_engine_starts_as_a_growable_one_rank_group",
        "tests/cluster/engine/test_elastic_join.py::test_grow_to_ep2_mid_generation_keeps_every_greedy_token",
    ),
    "elastic_ep_scale_timeout": (
        "tests/serve/test_field_effects.py::test_elastic_ep_scale_timeout_bounds_a_scale_whose_joiners_never_start",
    ),
    "enable_dp_attention": (
        "tests/cluster/engine/test_llm_dp.py::test_dp_ranks_ran_in_lockstep_with_idle_steps",
        "tests/cluster/engine/test_dp_scheduler.py::test_build_scheduler_picks_dp_only_with_dp_attention",
        "tests/cluster/engine/test_llm_ep.py::test_dp_attention_with_ep4_runs_moe_in_lockstep",
    ),
    "enable_hierarchical_cache": (
        "tests/cluster/engine/test_host_kv_tier.py::test_engine_with_a_host_tier_preempts_loads_and_still_equals_hf",
        "tests/cluster/engine/test_llm_tp.py::test_tp2_host_tier_loads_preempted_blocks_on_every_rank_and_matches_tp1",
    ),
    "enable_priority_scheduling": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_priority_flags",
        "tests/cluster/engine/test_schedule_policy.py::test_priority_levels_come_first_and_fcfs_orders_each_level",
    ),
    "ep_num_redundant_experts": (
        "tests/cluster/engine/test_llm_ep.py::test_tp2_ep2_greedy_matches_single_rank",
        "tests/cluster/models/test_expert_parallel.py::test_ep2_with_redundant_experts_matches_single_rank",
    ),
    "ep_size": (
        "tests/cluster/engine/test_llm_ep.py::test_tp2_ep2_greedy_matches_single_rank",
        "tests/cluster/models/test_expert_parallel.py::test_tp2_ep2_matches_single_rank",
    ),
    "expert_distribution_recorder_buffer_size": (
        "tests/cluster/engine/test_field_effects.py::test_expert_distribution_recorder_buffer_size_is_the_window_of_forward_passes",
    ),
    "expert_distribution_recorder_mode": (
        "tests/cluster/models/test_expert_load.py::test_engine_counts_match_hf_router_choices",
    ),
    "grammar_backend": (
        "tests/cluster/engine/test_grammar.py::test_each_backend_keeps_sampled_output_inside_the_constraint",
        "tests/cluster/engine/test_grammar.py::test_grammar_backend_none_refuses_constrained_requests",
    ),
    "hicache_ratio": (
        "tests/cluster/engine/test_host_kv_tier.py::test_engine_with_a_host_tier_preempts_loads_and_still_equals_hf",
    ),
    "hicache_size": (
        "tests/cluster/engine/test_field_effects.py::test_hicache_size_sizes_the_host_tier_in_gigabytes",
    ),
    "host": (
        "tests/deploy/test_field_effects.py::test_host_and_port_are_where_the_proxy_binds_and_what_the_url_names",
    ),
    "kv_cache_dtype": (
        "tests/cluster/engine/test_kv_cache_dtype.py::test_a_float8_cache_is_allocated_in_float8_at_half_the_bytes_per_token",
        "tests/cluster/engine/test_kv_cache_dtype.py::test_the_engine_decodes_over_a_float8_cache",
        "tests/cluster/engine/test_llm_fp8_kv.py::test_float8_cache_picks_the_bf16_cache_tokens_but_at_near_ties",
    ),
    "load_format": (
        "tests/cluster/engine/test_field_effects.py::test_load_format_dummy_serves_a_checkpoint_without_weights",
        "tests/cluster/models/test_dummy_weights.py::test_dummy_weights_are_deterministic_and_shaped_like_the_checkpoint",
    ),
    "log_level": (
        "tests/serve/test_request_log.py::test_log_level_sets_flotillas_loggers",
    ),
    "log_requests": (
        "tests/serve/test_request_log.py::test_no_request_log_without_the_flag",
        "tests/serve/test_request_log.py::test_json_lines_hold_what_each_level_asks",
    ),
    "log_requests_format": (
        "tests/serve/test_request_log.py::test_text_lines_are_key_value_pairs",
        "tests/serve/test_request_log.py::test_json_lines_hold_what_each_level_asks",
    ),
    "log_requests_level": (
        "tests/serve/test_request_log.py::test_json_lines_hold_what_each_level_asks",
        "tests/serve/test_request_log.py::test_level_two_cuts_long_text_and_level_three_keeps_it",
    ),
    "max_ep_size": (
        "tests/cluster/engine/test_elastic_join.py::test_growth_beyond_max_ep_size_is_refused",
        "tests/cluster/engine/test_elastic_join.py::test_grow_to_ep2_mid_generation_keeps_every_greedy_token",
        "tests/serve/test_elastic_ep_live.py::test_a_size_beyond_max_or_not_a_number_is_a_400_and_it_keeps_serving",
    ),
    "max_prefill_tokens": (
        "tests/cluster/engine/test_field_effects.py::test_max_prefill_tokens_is_the_step_budget_when_prefill_is_not_chunked",
    ),
    "max_queued_requests": (
        "tests/serve/test_field_effects.py::test_max_queued_requests_is_the_replicas_queue_bound",
        "tests/serve/test_app_live.py::test_burst_beyond_the_queue_bound_gets_429_never_5xx",
    ),
    "max_running_requests": (
        "tests/cluster/engine/test_field_effects.py::test_max_running_requests_caps_the_requests_running_at_once",
    ),
    "max_total_tokens": (
        "tests/cluster/engine/test_llm.py::test_tiny_kv_pool_preempts_and_still_equals_hf",
    ),
    "mem_fraction_static": (
        "tests/cluster/engine/test_field_effects.py::test_mem_fraction_static_sizes_a_cuda_kv_pool",
        "tests/gpu/test_fp8_kv_cache.py::test_a_float8_pool_holds_twice_the_tokens_of_a_bf16_pool",
    ),
    "model_path": (
        "tests/cluster/engine/test_llm.py::test_mixed_batch_greedy_equals_hf_generate",
    ),
    "moe_a2a_backend": (
        "tests/cluster/models/test_field_effects.py::test_moe_a2a_backend_picks_the_token_exchange_of_expert_parallel_layers",
        "tests/cluster/engine/test_llm_ep.py::test_tp2_ep2_greedy_matches_single_rank",
        "tests/cluster/models/test_expert_parallel.py::test_tp2_ep2_matches_single_rank",
    ),
    "page_size": (
        "tests/cluster/engine/test_field_effects.py::test_page_size_sets_the_tokens_of_each_kv_block",
        "tests/cluster/engine/test_llm.py::test_config_is_resolved_once_from_server_flags",
    ),
    "port": (
        "tests/deploy/test_field_effects.py::test_host_and_port_are_where_the_proxy_binds_and_what_the_url_names",
        "tests/deploy/test_field_effects.py::test_port_alone_moves_the_port_on_the_default_loopback_host",
        "tests/deploy/test_serve_job.py::test_ray_job_submit_deploys_a_config_file_and_stops_cleanly",
    ),
    "prefill_attention_backend": (
        "tests/cluster/engine/test_field_effects.py::test_split_attention_backend_fields_choose_the_attention_kernels",
        "tests/cluster/engine/test_kernel_backends.py::test_split_prefill_decode_fields_map_to_one_backend",
    ),
    "prefill_max_requests": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_schedule_policy_and_prefill_max_requests",
        "tests/cluster/engine/test_schedule_policy.py::test_prefill_max_requests_caps_admissions_per_step",
    ),
    "priority_scheduling_preemption_threshold": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_priority_preemption_flags",
        "tests/cluster/engine/test_schedule_policy.py::test_a_more_urgent_arrival_preempts_the_least_urgent_running_request",
    ),
    "random_seed": (
        "tests/cluster/engine/test_field_effects.py::test_random_seed_seeds_requests_without_their_own_seed",
    ),
    "reasoning_parser": (
        "tests/serve/test_agent_api.py::test_the_reasoning_parser_splits_reasoning_content",
    ),
    "revision": (
        "tests/cluster/models/test_revision.py::test_revision_picks_the_snapshot",
        "tests/cluster/models/test_revision.py::test_llm_loads_the_revision",
    ),
    "sampling_backend": (
        "tests/cluster/engine/test_kernel_backends.py::test_sampling_pytorch_and_dense_models_keep_torch",
        "tests/gpu/test_flashinfer_ops.py::test_sampler_flashinfer_backend_greedy_seeded_and_unseeded_rows",
    ),
    "schedule_low_priority_values_first": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_priority_flags",
    ),
    "schedule_policy": (
        "tests/cluster/engine/test_schedule_policy.py::test_engine_schedule_policy_and_prefill_max_requests",
        "tests/cluster/engine/test_schedule_policy.py::test_lpm_admits_the_longest_cached_prefix_first",
        "tests/cluster/engine/test_schedule_policy.py::test_dfs_weight_runs_the_branch_with_most_waiting_requests_first",
        "tests/cluster/engine/test_schedule_policy.py::test_lof_admits_the_longest_output_budget_first",
    ),
    "served_model_name": (
        "tests/serve/test_field_effects.py::test_served_model_name_is_the_name_models_reports_and_requests_must_use",
    ),
    "skip_tokenizer_init": (
        "tests/cluster/engine/test_field_effects.py::test_skip_tokenizer_init_loads_no_tokenizer",
        "tests/serve/test_token_ids.py::test_tokenless_server_sends_token_ids_by_default",
    ),
    "ssl_certfile": (
        "tests/deploy/test_serve_tls_live.py::test_the_openai_client_gets_answers_over_https",
        "tests/deploy/test_serve_tls_live.py::test_the_port_refuses_plain_http",
    ),
    "ssl_keyfile": (
        "tests/deploy/test_serve_tls_live.py::test_the_openai_client_gets_answers_over_https",
        "tests/deploy/test_serve_tls_live.py::test_the_port_refuses_plain_http",
    ),
    "ssl_keyfile_password": (
        "tests/deploy/test_serve_tls_options.py::test_an_encrypted_key_reaches_serve_with_its_password",
    ),
    "stream_interval": (
        "tests/serve/test_async_engine.py::test_stream_interval_batches_tokens_but_sends_the_first_at_once",
    ),
    "tokenizer_path": (
        "tests/cluster/engine/test_field_effects.py::test_tokenizer_path_loads_the_tokenizer_from_another_directory",
    ),
    "tool_call_parser": (
        "tests/serve/test_agent_api.py::test_auto_tool_choice_parses_hermes_calls_from_the_output",
        "tests/serve/test_agent_api.py::test_bad_agent_requests_get_400s_naming_the_parameter_and_the_server_keeps_serving",
    ),
    "tp_size": (
        "tests/cluster/engine/test_llm_tp.py::test_tp2_greedy_matches_tp1",
        "tests/cluster/engine/test_llm_tp.py::test_smollm2_tp3_greedy_matches_one_rank",
    ),
    "watchdog_timeout": (
        "tests/cluster/engine/test_field_effects.py::test_watchdog_timeout_bounds_the_wait_for_a_stuck_rank",
    ),
    "speculative_algorithm": (
        "tests/cluster/engine/test_speculative.py::test_eagle_drafts_its_heads_prediction_and_keeps_the_greedy_tokens",
        "tests/cluster/engine/test_speculative.py::test_nextn_drafts_transformers_mtp_prediction_and_keeps_the_greedy_tokens",
        "tests/cluster/engine/test_speculative.py::test_ngram_greedy_tokens_and_logprobs_equal_the_engine_without_speculation",
        "tests/cluster/engine/test_speculative.py::test_standalone_with_smollm2_as_its_own_draft_accepts_every_greedy_draft",
        "tests/cluster/engine/test_speculative.py::test_settings_that_cannot_run_are_refused_naming_the_flag",
    ),
    "speculative_num_draft_tokens": (
        "tests/cluster/engine/test_speculative.py::test_ngram_fields_reach_the_proposer",
    ),
    "speculative_num_steps": (
        "tests/cluster/engine/test_speculative.py::test_standalone_with_smollm2_as_its_own_draft_accepts_every_greedy_draft",
    ),
    "speculative_draft_model_path": (
        "tests/cluster/engine/test_speculative.py::test_eagle_drafts_its_heads_prediction_and_keeps_the_greedy_tokens",
        "tests/cluster/engine/test_speculative.py::test_standalone_with_smollm2_as_its_own_draft_accepts_every_greedy_draft",
        "tests/cluster/engine/test_speculative.py::test_the_draft_model_is_found_by_path_and_revision",
    ),
    "speculative_draft_model_revision": (
        "tests/cluster/engine/test_speculative.py::test_the_draft_model_is_found_by_path_and_revision",
    ),
    "speculative_draft_load_format": (
        "tests/cluster/engine/test_speculative.py::test_a_poor_draft_model_changes_the_speed_not_the_tokens",
    ),
    "speculative_draft_kv_cache_dtype": (
        "tests/cluster/engine/test_speculative.py::test_a_poor_draft_model_changes_the_speed_not_the_tokens",
    ),
    "speculative_ngram_max_trie_depth": (
        "tests/cluster/engine/test_speculative.py::test_ngram_fields_reach_the_proposer",
        "tests/cluster/engine/test_speculative.py::test_ngram_windows_are_at_most_the_trie_depth",
    ),
    "speculative_ngram_capacity": (
        "tests/cluster/engine/test_speculative.py::test_ngram_fields_reach_the_proposer",
        "tests/cluster/engine/test_speculative.py::test_ngram_capacity_clears_a_full_trie_and_refills",
    ),
}
