"""Training data tools: text corpora into token shards (``unbroken data prepare-text``) and the
reader the LLM workload trains from; ImageNet's validation set into class folders
(``unbroken data imagenet-val``). Every tool is resumable: killed at any point and run
again, it produces the same files as a run that was never interrupted."""
