"""Files and the machine: byte I/O on open files (`byte_io`), path rules inside DST (`paths`),
and what a job needs from the host: disk space, open files, memory (`resources`). Knows no
DeepSpeed format; formats/ and everything above use it."""
