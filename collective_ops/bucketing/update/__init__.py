"""After the collective, before the parameters are read again (framework-free).

``pending``: which buckets of a step still owe their update, with the settings frozen at ``step()``;
``overlap``: which owed buckets a forward's reads need, learnt from the forward itself;
``timeline``: the forward's use of buckets over time, the launch-order planner's input;
``schedule``: the launch-order simulator and the order trial; ``planner``: choosing and trying orders.
"""
