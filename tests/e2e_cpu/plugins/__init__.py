"""Small plugins written against slime's plugin API only (`slime.rollout.sglang_rollout`, `slime.utils.types`,
`slime.rollout.base_types`, `slime.rollout.data_source`, `slime.utils.http_utils`, ...), one per pattern of
slime's customization guide and examples; tests/e2e_cpu/test_plugins_e2e.py trains with them. Each records what
it was handed as JSON lines in the file named by $SLIME_PLUGIN_LOG, so the test can check the calls."""
