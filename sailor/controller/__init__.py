"""The controller: an asyncio daemon that keeps training going while nodes come and go.

Leader election, a level-triggered reconcile loop (pure ``decide`` + executor), the
reconfiguration state machine and the audit log. It never imports torch.
"""
