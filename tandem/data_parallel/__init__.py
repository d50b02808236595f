"""The data-parallel controller (--dp-size > 1): its own subprocess between the tokenizer side
and the replicas' schedulers."""
