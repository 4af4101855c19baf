"""The vLLM classes of ferry.vllm, where vLLM is installed: the entry point
registers the "ferry" backend with vLLM's factories, and the init and
update infos parse as vLLM parses them. Where `import vllm` fails (here:
vLLM is not installable on this machine) it prints "SKIPPED: no vLLM" and
exits 0; the logic behind the classes is python/tests/vllm_core_test.py's.

Usage: vllm_backend_test.py
"""

import sys


def main():
    try:
        import vllm  # noqa: F401
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as e:
        print("SKIPPED: no vLLM (%s)" % e)
        return 0
    import ferry.vllm as fv
    assert not fv.missing_vllm_api(), fv.missing_vllm_api()
    fv.register()
    assert "ferry" in WeightTransferEngineFactory._registry
    engine_cls = WeightTransferEngineFactory._registry["ferry"]()
    assert engine_cls is fv.FerryWeightTransferEngine
    info = engine_cls.init_info_cls(instance_id="vllm-0", socket="/run/ferry/ferryd.sock")
    assert info.stream == "policy"
    update = engine_cls.update_info_cls(version=3)
    assert update.version == 3
    print("vllm_backend_test: OK (vLLM %s)" % vllm.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
