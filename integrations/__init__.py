"""bitrl.integrations: bitrl's fused log-prob/entropy and policy losses inside other trainers.

Each integration imports its library lazily, inside the functions, so ``import bitrl.integrations`` needs
neither TRL nor verl::

    from bitrl.integrations.trl import use_bitrl      # TRL GRPOTrainer: use_bitrl(trainer, correction=...)
    from bitrl.integrations.verl import register      # verl: actor.policy_loss.loss_mode=bitrl_<loss>
    from bitrl.integrations.external import read_external_dump  # TRL / verl rollout dumps
"""
