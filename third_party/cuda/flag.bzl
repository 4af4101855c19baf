"""A boolean command-line build setting (Bazel 4 has no skylib here)."""

def _bool_flag_impl(ctx):
    return []

bool_flag = rule(
    implementation = _bool_flag_impl,
    build_setting = config.bool(flag = True),
)
