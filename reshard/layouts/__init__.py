"""Layouts, pure: where each element of each parameter sits at one topology. ZeRO partitions
(`zero`), AutoTP splits (`tensor_parallel`), pipeline stages (`pipeline`), native MoE experts
(`experts`, `expert_placement`, `zero0_expert_groups`), and the piece/box arithmetic that lowers
them to one global space (`tensor_pieces`, `local_to_global`, `boxes`, `strided_runs`). Each cites
the DeepSpeed file and function whose rule it mirrors. Imports only topology and errors."""
