"""benchmarks.diag.step_graph_ops on the CPU: per-step op counts of gem-tiny's compiled step, and what the weight
shadows remove (autocast's casts of the parameters that feed a GEMM, in the forward only)."""

from benchmarks.diag.step_graph_ops import count_step, format_runs


def test_weight_shadows_remove_the_forward_parameter_casts_and_leave_the_backward_as_it_was():
    plain = count_step("gem-tiny", 4, "cpu", [])
    shadowed = count_step("gem-tiny", 4, "cpu", ["weight_shadows=true", "shadow_adamw=false"])
    cast = "_to_copy[input->bfloat16, to GEMM]"
    assert plain["forward"]["by_op"][cast] > 0
    assert cast not in shadowed["forward"]["by_op"]
    assert shadowed["forward"]["gemms"] == plain["forward"]["gemms"] > 0
    assert shadowed["forward"]["ops"] < plain["forward"]["ops"]
    assert shadowed["backward"] == plain["backward"]  # the dW casts bf16 -> fp32 stay
    assert plain["backward"]["gemms"] > plain["forward"]["gemms"]  # dX and dW for each forward GEMM
    table = format_runs([plain, shadowed])
    assert f"{cast}  <- changed" in table and "(weight_shadows=true, shadow_adamw=false)" in table
