"""AppArgs validation, the builder's option merge, and the shipped YAML configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app._vllm import engine_cli_args
from serve_app.app import build_app, merge_options
from serve_app.config import VLLM_MAX_DEFAULT_MAX_NUM_SEQS, AppArgs, ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted([ROOT / "serve_config.yaml", *(ROOT / "configs").glob("*.yaml")])


class TestAppArgs:
    def test_defaults_are_the_builtin_model(self):
        args = AppArgs()
        assert args.model == "qwen3-tiny"
        assert not args.has_parser

    def test_unknown_fields_are_rejected(self):
        with pytest.raises(ValidationError, match="tool_parser"):
            AppArgs(tool_parser="hermes")

    def test_auto_tool_choice_requires_a_tool_parser(self):
        with pytest.raises(ValidationError, match="enable_auto_tool_choice requires tool_call_parser"):
            AppArgs(enable_auto_tool_choice=True)

    def test_tool_parser_counts_only_with_auto_tool_choice(self):
        # As in vLLM: without --enable-auto-tool-choice the tool parser is never built.
        assert not AppArgs(tool_call_parser="hermes").has_parser
        assert AppArgs(tool_call_parser="hermes", enable_auto_tool_choice=True).has_parser
        assert AppArgs(reasoning_parser="qwen3").has_parser

    def test_served_model_name_accepts_a_string(self):
        assert AppArgs(served_model_name="m").served_model_name == ["m"]

    def test_resolve_builtin(self, model_dirs):
        resolved = AppArgs(model="mistral-sp", max_model_len=1024).resolve()
        assert Path(resolved.model_dir) == model_dirs["mistral-sp"]
        assert resolved.served_model_names == ["mistral-sp"]
        assert resolved.max_model_len == 1024
        assert AppArgs(model="qwen3-tiny").resolve().max_model_len == 4096  # max_position_embeddings


class TestEngineArgs:
    """``engine:`` takes vLLM's engine arguments by name, vLLM's defaults otherwise, checked by vLLM."""

    def test_defaults_are_vllms(self, model_dirs):
        args = AppArgs(engine={"enabled": True})
        assert args.engine.vllm_args() == {"tokens_only": False}
        argv = engine_cli_args(args, args.resolve())
        # No demo settings: CUDA graphs, vLLM's max_num_seqs, a tokenizer in the engine.
        for flag in ("--enforce-eager", "--max-num-seqs", "--tokens-only", "--kv-cache-memory-bytes", "--dtype"):
            assert flag not in argv
        assert "--enable-scale-out" in argv and argv[argv.index("--tokenizer") + 1] == str(model_dirs["qwen3-tiny"])

    def test_any_vllm_argument_by_name_becomes_its_flag(self):
        engine = {
            "tensor_parallel_size": 2,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "logits_processors": ["a:B", "c:D"],
            "hf_overrides": {"rope_theta": 1.0},
            "extra_engine_args": {"gpu_memory_utilization": 0.8},
        }
        args = AppArgs(engine=engine)
        assert args.engine.vllm_args() == {
            "tokens_only": False,
            "tensor_parallel_size": 2,
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "logits_processors": ["a:B", "c:D"],
            "hf_overrides": {"rope_theta": 1.0},
            "gpu_memory_utilization": 0.8,
        }
        argv = " ".join(engine_cli_args(args, AppArgs().resolve()))
        assert "--tensor-parallel-size 2 --enforce-eager --no-enable-prefix-caching --logits-processors a:B c:D" in argv
        assert '--hf-overrides {"rope_theta": 1.0} --gpu-memory-utilization 0.8' in argv

    def test_max_num_seqs_for_servers_queue_bounds(self):
        assert AppArgs(engine={"max_num_seqs": 16}).engine.max_num_seqs == 16
        assert AppArgs().engine.max_num_seqs == VLLM_MAX_DEFAULT_MAX_NUM_SEQS  # vLLM's largest default

    @pytest.mark.parametrize(
        ("engine", "message"),
        [
            ({"max_num_sequences": 8}, "unknown vLLM engine argument.*max_num_sequences"),
            ({"extra_engine_args": {"not_an_arg": True}}, "unknown vLLM engine argument.*not_an_arg"),
            ({"max_num_seqs": "lots"}, "argument --max-num-seqs: invalid int value: 'lots'"),
            ({"dtype": "float17"}, "argument --dtype: invalid choice: 'float17'"),
            ({"tensor_parallel_size": 3}, r"attention heads \(2\) must be divisible by tensor parallel size \(3\)"),
        ],
    )
    def test_vllm_rejects_a_bad_argument_at_build_time_by_name(self, model_dirs, engine, message):
        with pytest.raises(ConfigError, match=message) as info:
            AppArgs(engine={"enabled": True, **engine}).resolve()
        exc = info.value  # no lower layer's traceback: nothing chained, or chained `from None`
        assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)

    def test_app_level_keys_are_refused_under_engine(self):
        with pytest.raises(ValidationError, match="engine.tokenizer_mode: set tokenizer_mode at the top level"):
            AppArgs(engine={"tokenizer_mode": "mistral"})

    def test_cpu_demo_settings_are_explicit_in_serve_config(self):
        config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
        engine = AppArgs.model_validate(config["applications"][0]["args"]).engine.vllm_args()
        assert engine == {"tokens_only": True, "enforce_eager": True, "max_num_seqs": 16, "kv_cache_memory_bytes": 1 << 30}


class TestBuilder:
    def test_user_options_deep_merge_over_defaults(self):
        merged = merge_options(
            {"num_replicas": 1, "ray_actor_options": {"num_cpus": 1, "memory": 5}},
            {"autoscaling_config": {"max_replicas": 4}, "ray_actor_options": {"num_cpus": 2}},
        )
        assert merged == {"autoscaling_config": {"max_replicas": 4}, "ray_actor_options": {"num_cpus": 2, "memory": 5}}

    def test_fixed_replicas_replace_a_default_autoscaling_config(self, model_dirs):
        """``num_replicas: 2`` on an autoscaled-by-default stage (Serve rejects both at once)."""
        merged = merge_options({"autoscaling_config": {"max_replicas": 4}, "max_ongoing_requests": 8}, {"num_replicas": 2})
        assert merged == {"num_replicas": 2, "max_ongoing_requests": 8}
        app = build_app(AppArgs(reasoning_parser="qwen3", deployments={"parser_derender": {"num_replicas": 2}}))
        parser = app._bound_deployment.init_args[4]
        assert parser._bound_deployment._deployment_config.num_replicas == 2
        assert parser._bound_deployment._deployment_config.autoscaling_config is None

    def test_rescaling_a_stage_leaves_every_deployments_args_unchanged(self, model_dirs):
        """Deployment options reach Serve as options, not in the replicas' args: a new replica count
        is Serve's lightweight update, not a new version (and a restart) of every deployment."""
        one = build_app(AppArgs(reasoning_parser="qwen3", deployments={"parser_derender": {"num_replicas": 1}}))
        two = build_app(AppArgs(reasoning_parser="qwen3", deployments={"parser_derender": {"num_replicas": 2}}))
        args_one, args_two = one._bound_deployment.init_args[0], two._bound_deployment.init_args[0]
        assert args_one == args_two and args_one.deployments == AppArgs().deployments
        parsers = [app._bound_deployment.init_args[4]._bound_deployment for app in (one, two)]
        assert [p._deployment_config.num_replicas for p in parsers] == [1, 2]
        assert parsers[0].init_args[0] == parsers[1].init_args[0]

    def test_bound_app_carries_merged_options(self, model_dirs):
        app = build_app(AppArgs(deployments={"ingress": {"max_ongoing_requests": 7}}))
        config = app._bound_deployment._deployment_config
        assert config.max_ongoing_requests == 7
        assert app._bound_deployment.name == "Ingress"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path):
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for application in schema.applications:
        assert application.import_path == "serve_app.app:build_app"
        AppArgs.model_validate(application.args)
