"""Shared pytest setup: locations of the shared test data."""
import gc
import os
import pathlib

import jax.numpy as jnp
import pytest

# Several host devices for the data-parallel rank tests (test_ranks.py): XLA reads this
# when jax creates its CPU client, so it must be set before any test touches a backend.
# The default device is still the first one, so single-device tests run as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=4").strip()

REPO = pathlib.Path(__file__).resolve().parent.parent
# ../shared beside the checkout (as laid out for sessions and CI); JAX_KVALLOC_SHARED overrides.
SHARED = pathlib.Path(os.environ.get("JAX_KVALLOC_SHARED", REPO.parent / "shared"))
GOLDEN = SHARED / "golden" / "traces.jsonl"


# The default run (the README's test command) deselects `slow`; .ci/run runs both sets.
# What is slow, in one place. Each entry: (file, test name, predicate on the item, why).
def _param(item, name, default=None):
  spec = getattr(item, "callspec", None)
  return spec.params.get(name, default) if spec is not None else default


_FAST_MACHINES = {"token-ps1-n24-sort0-dbg0", "paged-ps4-n12-sort0-dbg0",
                  "paged-ps16-n8-sort1-dbg0", "paged-ps3-n12-sort1-dbg1"}
SLOW_TESTS = [
    ("test_parity.py", "test_cli_lock_step_parity", None, "~480 lock-step steps in a subprocess"),
    ("test_parity.py", "test_cli_triton_interpreter_replays_golden", None, "Triton interpreter"),
    ("test_parity.py", "test_triton_kernels_against_torch_path", None, "Triton interpreter"),
    ("test_parity.py", "test_cli_reports_first_mismatch_and_saves_trace", None, "subprocess"),
    ("test_stress.py", "*", None, "stress: thousands of cycles, largest pools"),
    ("test_golden.py", "test_golden_trace",
     lambda it: _param(it, "trace_id", 0) >= (10 if _param(it, "backend") == "device" else 5),
     "traces 0-9 (every page size, need_sort on and off; host backend 0-4) by default"),
    ("test_properties.py", "test_allocator_state_machine",
     lambda it: it.name.split("[")[1].rstrip("]") not in _FAST_MACHINES,
     "four of the nine hypothesis machines by default"),
    ("test_random_traces.py", "test_classes_match_model_on_random_traces",
     lambda it: _param(it, "ps") == 64, "page size 64 traces compile the largest buckets"),
    ("test_random_traces.py", "*", lambda it: "without_jit" in it.name, "eager op by op"),
    ("test_spec.py", "*", lambda it: "without_jit" in it.name, "eager op by op"),
    ("test_debug.py", "test_valid_serving_traces_are_silent", None, "long random traces"),
    ("test_newer_ops.py", "test_alloc_extend_num_new_pages", None, "every path, debug too"),
    ("test_newer_ops.py", "test_debug_mode_refuses_bad_page_id_frees", None, "debug compiles"),
    ("test_newer_ops.py", "*", lambda it: "_segment_frees_replay_on_" in it.name,
     "generated traces through every implementation"),
    ("test_jit.py", "test_vmap_over_independent_pools", None, "vmapped compiles"),
    ("test_swa.py", "test_core_matches_model", None, "jitted SWA core, every op compiled"),
    ("test_swa.py", "test_device_class_matches_sglang_0_5_23", None, "device SWA compiles"),
    ("test_swa.py", "test_long_traces_all_impls_match_sglang", None, "long SWA traces"),
    ("test_swa_table.py", "test_table_matches_model", None, "SWA table steps, compiles"),
    ("test_swa.py", "test_class_debug_mode_checks_peers", None, "debug-mode compiles"),
    ("test_swa.py", "*", lambda it: _param(it, "backend") == "device" or (
        _param(it, "which") in ("device", "core") and it.originalname in (
            "test_token_vector", "test_decode_refused_unless_both_pools_fit")),
     "SWA device-backend class and core compiles beyond the paged vectors"),
    ("test_swa_no_wait.py", "test_swa_device_class_serving_does_not_wait",
     lambda it: "True" in it.name, "need_sort with a device last_loc: the second variant"),
    ("test_host_backend.py", "test_small_path_matches_general_path_and_device",
     lambda it: "-16]" in it.name, "page size 4 runs by default"),
    ("test_host_backend.py", "test_parity_with_host_backend_leading", None, "parity run"),
    ("test_random_traces.py", "test_classes_match_model_on_random_traces",
     lambda it: _param(it, "ps") == 16, "page sizes 1 and 4 run by default"),
    ("test_pallas_lowering.py", "test_mosaic_kernel_under_tpu_interpreter",
     lambda it: "[0]" not in it.name, "the TPU interpreter; case 0 runs by default"),
    ("test_triton_free.py", "test_every_slot_kind_equals_the_sort",
     lambda it: "-default]" not in it.name and "[23-40-1-small]" not in it.name,
     "Pallas' interpreter; the default blocks and one many-program case run by default"),
    ("test_triton_free.py", "test_free_states_equal_the_sort",
     lambda it: "-default-" not in it.name and "[1-300-500-small-True]" not in it.name,
     "Pallas' interpreter; the default blocks and one release-list case run by default"),
    ("test_free_methods.py", "test_free_states_are_identical_and_match_the_model",
     lambda it: "True]" in it.name, "need_sort off (the default) runs by default"),
    ("test_warmup.py", "test_persistent_cache_second_process_compiles_nothing", None,
     "two subprocesses, each importing jax (9 s idle, 30-40 s on a loaded machine)"),
    ("test_warmup.py", "test_device_last_loc_after_warmup_compiles_nothing", None,
     "compiles every bucket twice"),
    ("test_barriers.py", "test_a_dropped_barrier_fails", None,
     "the mutation check lowers both kernels again; the barrier counts run by default"),
    ("test_extend_layouts.py", "test_layouts_exhaustive", None,
     "every page size and layout, many pools, in Pallas' interpreter"),
    ("test_multiprocess.py", "test_two_processes_equal_one_every_op", None,
     "three JAX processes compiling every ranked operation; the serving ones run by default"),
    ("test_multiprocess.py", "test_bench_processes_runs", None, "starts JAX processes"),
    ("test_attention.py", "test_every_kernel_page_sizes_slow", None,
     "page sizes 1, 16, 64 through every kernel (ref eager, TPU/GPU interpreters)"),
]


# Tests of the default set whose cost is their own, not their breadth: slow as a whole.
HEAVY_TESTS = [
    ("test_cli.py", "test_leak_check_fires_on_a_dropped_free",
     "a simulate run (test_simulate_swa's leak checks and the device-free one run in CI)"),
    ("test_attention.py", "test_tpu_decode_kernel_reads_dense_form",
     "the TPU interpreter (its lowering test runs by default)"),
    ("test_simulate_swa.py", "test_swa_pool_counts_follow_the_model", "compiles the SWA loop"),
    ("test_simulate_swa.py", "test_leak_check_fires_on_a_dropped_swa_free",
     "compiles the SWA loop"),
    ("test_simulate_swa.py", "test_final_leak_check_covers_both_pools_and_the_mapping",
     "compiles the SWA loop"),
    ("test_swa_dispatch.py", "test_one_launch_per_steady_call", "compiles every SWA program"),
    ("test_swa_dispatch.py", "test_warmup_compiles_every_serving_program",
     "the SWA class's warm-up compiles every serving program"),
    ("test_swa_dispatch.py", "test_sizes_within_a_bucket_compile_nothing_new",
     "compiles the SWA extend and decode programs"),
    ("test_readme.py", "*", "every README example (about 50 s of compiles)"),
    ("test_swa_no_wait.py", "test_swa_device_class_serving_does_not_wait", "long serving sequence"),
    ("test_swa_no_wait.py", "test_swa_debug_mode_checks_device_segments", "debug compiles"),
    ("test_cli.py", "test_simulate_json_plot_and_table", "three simulate runs"),
    ("test_cli.py", "test_simulate_persistent_cache_reports_hits",
     "a simulate compile, then its load from the persistent cache"),
    ("test_cli.py", "test_leak_check_fires_when_the_device_free_loses_pages", "a simulate run"),
    ("test_traces.py", "test_jax_kvalloc_replays_generated_traces", "generated traces"),
    ("test_warmup.py", "test_no_compile_after_warmup", "compiles every bucket"),
    ("test_triton_free.py", "test_auto_picks_the_kernels_only_on_the_triton_path",
     "lowers every path"),
    ("test_swa.py", "test_paged_vector", "the vector through every implementation"),
    ("test_simulate_drivers.py", "*", "compiles both drivers"),
    ("test_capacity.py", "test_auto_uses_the_pools_device_not_the_default_backend",
     "compiles every path"),
    ("test_debug.py", "test_works_under_vmap", "vmapped debug compiles"),
    ("test_attention.py", "test_ragged_reference_reads_every_form", "every form, eager"),
    ("test_pallas_alloc.py", "test_classes_with_pallas_interpret_follow_the_model",
     "classes in Pallas' interpreter"),
    ("test_request_table.py", "test_vmap_over_pools", "vmapped compiles"),
    ("test_cli.py", "test_simulate_exact_page_accounting_without_sharing", "a simulate run"),
    ("test_cli.py", "test_trace_replay", "a simulate run and its replay"),
    ("test_simulate_swa.py", "test_swa_pool_counts_follow_the_model_more",
     "two more SWA simulate compiles"),
    ("test_simulate_swa.py", "test_window_zero_is_the_run_without_an_swa_pool",
     "a simulate compile without an SWA pool"),
    ("test_capacity.py", "test_mosaic_contract_near_int32_max_under_tpu_interpreter",
     "the TPU interpreter"),
    ("test_ranks.py", "test_sharded_ranks_match_the_model", "sharded compiles"),
    ("test_ranks.py", "test_sharded_results_equal_unsharded", "sharded compiles"),
    ("test_ranks.py", "test_vmapped_need_sort_decode_sorts_only_in_a_branch", "vmapped compiles"),
    ("test_ranks.py", "test_bench_ranks_runs_on_host_devices", "a bench run"),
    ("test_ranks_classes.py", "test_debug_mode_and_warmup_per_rank", "debug and warm-up"),
    ("test_release_decode.py", "test_empty_release_and_num_none", "every path"),
    ("test_extend_layouts.py", "test_near_int32_max", "near-2**31 pools in the interpreter"),
    ("test_free_methods.py", "test_methods_agree_under_vmap", "vmapped compiles"),
    ("test_pallas_lowering.py", "test_mosaic_kernel_under_tpu_interpreter",
     "the TPU interpreter (the lowering tests run by default)"),
    ("test_bench_harness.py", "test_serving_scan_keeps_every_step", "the serving scans"),
    ("test_serve_model.py", "*", "SmolLM2-135M and transformers' reference (model extras)"),
    ("test_export_hf.py", "test_folder_loads_in_transformers_with_our_logits",
     "exports SmolLM2-135M, loads it in transformers (model extras)"),
    ("test_export_hf.py", "test_the_files_say_what_the_gguf_says", "exports SmolLM2-135M"),
    ("test_sgljax_engine.py", "*", "sglang-jax's engine serving SmolLM2-135M, six runs "
     "(Python 3.12 with sglang-jax)"),
    ("test_serve_engine.py", "test_unrolled_layers_equal_scanned_ones", "a third compile"),
    ("test_serve_engine.py", "test_bench_writes_a_result_folder", "four engines compile"),
    ("test_serve_engine.py", "test_pallas_decode_in_the_interpreter_equals_gather",
     "Pallas' interpreter"),
    ("test_request_table.py", "test_random_workload_matches_model",
     "a random workload (tests/test_table_kernels.py runs one against the model by default)"),
    ("test_ranks_classes.py", "test_every_rank_matches_the_model_while_the_others_stay",
     "every rank's trace"),
    ("test_pallas_alloc.py", "test_need_sort_merge_then_fused_kernel", "the interpreter"),
    ("test_release_decode.py", "test_serving_step_fused_release_equals_page_release",
     "two serving scans"),
    ("test_free_methods.py", "test_default_free_takes_auto", "every path"),
    ("test_guard.py", "test_swa_pools_keep_their_own_records", "SWA table compiles"),
    ("test_guard.py", "test_request_table_release_refusal_keeps_the_rows",
     "table compiles (the table kernels' guarded release runs by default in "
     "test_table_kernels)"),
    ("test_guard.py", "test_free_kernel_across_programs_equals_the_rules",
     "the free kernels over many programs in the interpreter"),
    ("test_guard.py", "test_status_survives_vmap_scan_and_donation", "scan and vmap compiles"),
    ("test_guard.py", "test_ranks_over_a_mesh_refuse_per_rank", "sharded compiles"),
    ("test_guard.py", "test_release_and_alloc_decode_refused_release_refuses_the_decode",
     "the kernel in the interpreter (test_release_decode's guarded cases run by default)"),
]


# Cases beyond what CI's 20 minutes hold (slow and exhaustive: `-m exhaustive` runs them).
# Each test function here keeps cases in the default or slow set, which CI runs, or (a
# whole test) names the tests that cover the same ground in CI.
# (file, test, rule, why); rule: the first exhaustive case by collection order, or a
# predicate on the item.
_NAMED = lambda *parts: lambda it: any(p in it.name for p in parts)  # noqa: E731
EXHAUSTIVE_TESTS = [
    ("test_swa.py", "test_device_class_matches_sglang_0_5_23", 0,
     "the device SWA class against SGLang 0.5.23 (the class code is one for every backend: "
     "test_host_class_matches_sglang_0_5_23 runs it against SGLang, test_swa_dispatch the "
     "device programs against the host backend, test_swa_no_wait against the model)"),
    ("test_golden.py", "test_golden_trace", 30, "traces past the first 30 cases"),
    ("test_refusals.py", "test_refusals_raise_and_change_nothing_on_every_backend",
     _NAMED("-debug]"), "the SPEC 14 cases in debug mode (debug runs the device programs "
     "the device cases check, plus its own checks, which test_debug covers)"),
    ("test_simulate_drivers.py", "test_branch_free_step_makes_the_same_decisions",
     _NAMED("[fused]", "[need_sort]"), "the fused and need_sort forms of the branch-free "
     "step (the triton and swa forms run in CI)"),
    ("test_random_traces.py", "test_classes_match_model_on_random_traces", 6, "more seeds"),
    ("test_properties.py", "test_allocator_state_machine", 6, "more hypothesis machines"),
    ("test_simulate_drivers.py", "test_policy_under_pressure",
     lambda it: not _NAMED("[ps1-sort0-share", "[ps16-sort1-share")(it),
     "page size x need_sort x sharing beyond page size 1 without need_sort and 16 with it"),
    ("test_no_wait.py", "test_host_mirror_is_exact_on_random_traces", 4, "more traces"),
    ("test_triton_free.py", "test_free_states_equal_the_sort", 4, "more pools"),
    ("test_triton_free.py", "test_every_slot_kind_equals_the_sort", 4, "more pools"),
    ("test_request_table.py", "test_random_workload_matches_model", 4, "more workloads"),
    ("test_extend_layouts.py", "test_layouts_exhaustive", 0,
     "every page size and layout (test_rows_layout_blocks_and_chunks and "
     "test_tiles_layout_through_the_allocator run each layout in CI)"),
    ("test_free_methods.py", "test_free_states_are_identical_and_match_the_model", 4,
     "more pools"),
    ("test_table_kernels.py", "test_kernel_equals_jnp_path", 1,
     "more page sizes (4 runs in CI, and the table's other tests at 1, 16 and 64)"),
    ("test_swa.py", "test_long_traces_all_impls_match_sglang", 0,
     "long traces (the default set's SGLang lock-step traces run in CI)"),
    ("test_newer_ops.py", "test_random_traces_against_sglang", _NAMED("-64]"),
     "page size 64 (1 and 4 run in CI; 64 in test_golden and the parity CLI)"),
    ("test_attention.py", "test_every_kernel_page_sizes_slow", _NAMED("[64-"),
     "page size 64 (1 and 16 run in CI)"),
    ("test_swa.py", "test_core_matches_model", _NAMED("[4-True-80]"),
     "page size 4 with need_sort (page size 1 runs in CI)"),
    ("test_host_backend.py", "test_small_path_matches_general_path_and_device", _NAMED("-16]"),
     "page size 16 (1 and 4 run in CI)"),
    ("test_serve_engine.py", "test_paged_without_prefix_cache_equals_contiguous_bit_for_bit", 0,
     "the paged run without its prefix cache (the default set compares the prefix-cached "
     "run with the contiguous one bit for bit)"),
    ("test_stress.py", "test_fill_and_drain_to_exact_capacity_thousands_of_times",
     _NAMED("[paged-16-32-True-False]", "[paged-4-64-True-True]"),
     "more pools (a paged and a token pool run in CI)"),
    ("test_capacity.py", "test_extend_near_int32_max_all_paths", 2, "more near-2**31 cases"),
    ("test_extend_layouts.py", "test_near_int32_max", 1, "the other layout (rows runs)"),
    ("test_simulate_swa.py", "test_swa_pool_counts_follow_the_model_more", _NAMED("[64-True-"),
     "page size 64 with need_sort (the window shorter than a page runs in CI)"),
    ("test_parity.py", "test_cli_triton_interpreter_replays_golden", 0,
     "the golden traces through torch_ref's Triton kernels in the interpreter "
     "(test_triton_kernels_against_torch_path and the lock-step CLI run them in CI)"),
    ("test_multiprocess.py", "test_two_processes_equal_one_every_op", 0,
     "every ranked op over processes (the serving ops over processes run in CI)"),
    ("test_multiprocess.py", "test_bench_processes_runs", 0, "the processes benchmark's smoke run"),
    ("test_table_kernels.py", "test_kernel_equals_jnp_path_larger", 0,
     "larger tables (the other shapes of test_kernel_equals_jnp_path run in CI)"),
    ("test_swa_no_wait.py", "test_swa_device_class_serving_does_not_wait", _NAMED("[True-True]"),
     "need_sort with device inputs (the other variant runs in CI)"),
    ("test_random_traces.py", "*", lambda it: "without_jit" in it.name,
     "eager traces (the same traces run jitted in CI)"),
    ("test_properties.py", "test_core_state_machine_with_misuse",
     _NAMED("[paged-ps1-n24-sort1-mosaic", "[paged-ps16-n8-sort1-mosaic"),
     "the Mosaic index kernel in two more pools (paged page size 4 and the token pool "
     "run in CI)"),
    ("test_newer_ops.py", "test_random_traces_against_model",
     lambda it: not _NAMED("[False-4]", "[False-1]", "[True-16]")(it),
     "more traces (page sizes 1 and 4, and 16 with need_sort, run in CI)"),
    # CI time (.ci/run under 20 minutes): each of these keeps a case per path in CI.
    ("test_properties.py", "test_core_state_machine_with_misuse",
     _NAMED("[token-ps1-n24-sort0-mosaic", "[token-ps1-n24-sort0-triton",
            "[paged-ps1-n24-sort1-triton", "[paged-ps16-n8-sort1-triton"),
     "each kernel path's misuse machine in more pools (every path runs at page size 4 in "
     "CI, the jnp path in every pool)"),
    ("test_ranks.py", "test_every_rank_matches_its_model",
     _NAMED("[token-1-48-True]", "[paged-1-48-False]", "[paged-1-48-True]"),
     "more pools (a paged pool with need_sort and a token pool run in CI)"),
    ("test_bench_harness.py", "test_serving_scan_keeps_every_step", _NAMED("[pages]", "[fused]"),
     "the scan with page outputs and the fused XLA path (the plain scan and the fused "
     "kernel in the interpreter run in CI)"),
    ("test_table_kernels.py", "test_random_workload_matches_model", _NAMED("[1]", "[64]"),
     "page sizes 1 and 64 (4 runs in CI, and the table's other tests at 1, 16 and 64)"),
    ("test_newer_ops.py", "test_random_traces_against_model_host_backend",
     _NAMED("[False-128]", "[True-4]", "[True-128]"),
     "more host-backend traces (page size 4, and 1 with need_sort, run in CI)"),
    ("test_ranks_classes.py", "test_every_rank_matches_the_model_while_the_others_stay",
     _NAMED("[False-host]", "[True-device]"),
     "the other backend of each need_sort setting (both backends run in CI)"),
    ("test_pallas_kernels.py", "test_decode_indices",
     _NAMED("[triton-4]", "[triton-16]", "[triton-128]", "[mosaic-2]", "[mosaic-4]",
            "[mosaic-16]", "[mosaic-64]"),
     "more page sizes per kernel (1-2, 64 and 128 run in CI)"),
    ("test_pallas_kernels.py", "test_extend_indices",
     _NAMED("[triton-4]", "[triton-16]", "[triton-128]", "[mosaic-2]", "[mosaic-4]",
            "[mosaic-16]", "[mosaic-64]"),
     "more page sizes per kernel (1-2, 64 and 128 run in CI)"),
    ("test_release_decode.py", "test_kernel_equals_composition_and_model",
     _NAMED("[4]", "[16]", "[128]"), "more page sizes (1, 2 and 64 run in CI)"),
    ("test_pallas_alloc.py", "test_alloc_decode_matches_jnp_and_model",
     _NAMED("[4]", "[16]", "[128]"), "more page sizes (1, 2 and 64 run in CI)"),
    ("test_stress.py", "test_class_fill_and_drain_matches_the_model", _NAMED("[False]"),
     "without need_sort (with need_sort runs in CI)"),
    ("test_no_wait.py", "test_device_class_calls_do_not_wait", _NAMED("[True-False]", "[False-True]"),
     "two more input forms (host inputs and device inputs with need_sort run in CI)"),
    ("test_host_backend.py", "test_small_path_matches_general_path_and_device",
     _NAMED("[False-4]", "[True-1]"), "more pools (page sizes 1 and 4 run in CI)"),
    ("test_ranks_processes_class.py", "test_held_ranks_match_the_full_allocator",
     _NAMED("[token-host]"), "the token pool on the host backend (on the device in CI)"),
]


def _mark_slow(item, why: str) -> None:
  item.add_marker(pytest.mark.slow(reason=why))


def pytest_collection_modifyitems(config, items):
  del config
  first_case = set()   # (file, test) pairs whose default case is taken
  case_index = {}      # (file, test) -> cases seen so far
  for item in items:
    name = getattr(item, "originalname", item.name.split("[")[0])
    index = case_index.get((item.path.name, name), 0)
    case_index[(item.path.name, name)] = index + 1
    for file, test, rule, why in EXHAUSTIVE_TESTS:
      if item.path.name == file and test in ("*", name) and (
          rule(item) if callable(rule) else index >= rule):
        item.add_marker(pytest.mark.exhaustive(reason=why))
        _mark_slow(item, why)
        break
    if item.get_closest_marker("exhaustive"):
      continue
    if any(item.path.name == f and n in ("*", name) for f, n, _ in HEAVY_TESTS):
      _mark_slow(item, "heavy")
      continue
    for file, test, pred, why in SLOW_TESTS:
      if item.path.name == file and test in ("*", name, item.name.split("[")[0]):
        if pred is None or pred(item):
          _mark_slow(item, why)
          break
    else:
      # The default set runs every test function once: its first remaining case. The
      # other cases (page sizes, backends, seeds) run in the slow set, which CI runs too.
      key = (item.path.name, item.cls.__name__ if item.cls else "", name)
      if key in first_case:
        _mark_slow(item, "more cases of a test whose first case runs by default")
      else:
        first_case.add(key)
  _order_costliest_first(items)


# With `--dist loadfile` (pyproject's addopts) each worker runs whole files in collection
# order as they come free: the costliest files (CPU seconds in CI, roughly) go first so
# that the workers finish together rather than one waiting on a late large file.
COSTLIEST_FIRST = ["test_serve_model.py", "test_newer_ops.py", "test_table_kernels.py", "test_parity.py",
                   "test_swa.py", "test_cli.py", "test_multiprocess.py",
                   "test_extend_layouts.py", "test_pallas_alloc.py", "test_release_decode.py",
                   "test_attention.py", "test_bench_harness.py", "test_capacity.py",
                   "test_simulate_drivers.py", "test_request_table.py", "test_warmup.py"]


def _order_costliest_first(items) -> None:
  rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
  items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: order within


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
  config.addinivalue_line("markers", "slow: long-running; deselect with -m 'not slow'")
  config.addinivalue_line("markers", "exhaustive: more cases than CI runs (-m exhaustive)")


def pytest_sessionfinish(session):
  """The session's garbage collected, then every object left frozen (`gc.freeze`), before
  this process reports its session finished: pytest collects once more at unconfigure
  (for unraisable exceptions), a full pass over the ~10^6 objects a session of jax
  programs holds (about a second). A pytest-xdist worker still
  busy 5 s after the controller ends the session is sent SIGINT by execnet; landing in
  that pass, it becomes the KeyboardInterrupt "in hypothesis' gc callback" reported as a
  PytestUnraisableExceptionWarning. Collected here, while the controller still waits for
  the worker, unraisable exceptions are still reported, and the last pass is instant."""
  del session
  gc.collect()
  gc.freeze()


# Each compiled program holds memory maps; a worker that runs many modules can near
# vm.max_map_count (65530), where XLA can fail inside (a segfault), not with an error.
# Past MAX_MAPS, jax's caches are dropped before the next module (only then: it
# recompiles).
_MAPS = pathlib.Path("/proc/self/maps")
MAX_MAPS = int(os.environ.get("JAX_KVALLOC_TEST_MAX_MAPS", "40000"))


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
  if _MAPS.exists():
    with open(_MAPS, "rb") as f:
      if f.read().count(b"\n") > MAX_MAPS:
        import jax  # pylint: disable=g-import-not-at-top
        jax.clear_caches()
        gc.collect()
  yield


@pytest.fixture(scope="session")
def golden_path():
  if not GOLDEN.exists():
    message = f"golden traces not found at {GOLDEN} (set JAX_KVALLOC_SHARED)"
    if os.environ.get("CI"):
      pytest.fail(message)  # CI never skips them silently
    pytest.skip(message)
  return GOLDEN


@pytest.fixture
def drop_first_free(monkeypatch):
  """drop_first_free(module): patches module.release_rows (jax_kvalloc.request_table or
  swa_table) so that the first row of every release frees nothing (its pages are no
  longer the row's), for `jax-kvalloc simulate`'s leak checks to find. The simulator's
  compiled loops are dropped before the patched run and after the test."""
  from jax_kvalloc import swa_table  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import simulate  # pylint: disable=g-import-not-at-top

  def patch(module):
    real = module.release_rows

    def dropping(config, state, table, rows, *, num_rows=None):
      n = table.lens.shape[0]
      first = jnp.where(num_rows > 0, rows[0], n)
      if module is swa_table:
        table = table._replace(lens=table.lens.at[first].set(0, mode="drop"))
      else:
        end = -(-table.lens[jnp.minimum(first, n - 1)] // config.page_size)
        table = table._replace(owned_from=table.owned_from.at[first].set(end, mode="drop"))
      return real(config, state, table, rows, num_rows=num_rows)
    monkeypatch.setattr(module, "release_rows", dropping)
    simulate.clear_compiled()

  yield patch
  simulate.clear_compiled()
