"""Running the model across processes: worker groups (workers), tensor parallelism
(tensor_parallel, Megatron-LM), pipeline parallelism (pipeline, GPipe) and expert parallelism
(expert_parallel, GShard)."""
