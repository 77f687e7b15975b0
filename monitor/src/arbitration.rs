//! Who gets how much of a GPU: the effective compute shares the monitor
//! writes into each container's region (`sm_effective`, basis points).
//!
//! [`arbitrate`] is a pure function of one GPU's containers (their settings
//! and whether they are active) so the rule can be read, tested and reasoned
//! about on its own. The rule, per GPU:
//!
//! 1. **Priority.** Let *top* be the most important priority (the lowest
//!    `CUDA_TASK_PRIORITY` value) among the *active* containers on the GPU,
//!    whatever their policy. Every `default`-policy container that is less
//!    important than *top* is **paused** (effective share 0), capped or
//!    uncapped, active or not, for as long as such a container is active.
//!    With no active container, nobody is paused.
//! 2. **Own share.** Every other `default`-policy container gets its
//!    configured share (an uncapped one stays unlimited). An idle container
//!    keeps its configured share too, so an owner that becomes active runs
//!    at its share at once, without waiting for the monitor.
//! 3. **Lending.** The capacity the running containers do not claim is lent
//!    to the active, capped `default`-policy containers (all at priority
//!    *top*) whose burst share exceeds their share: pool = 100 % minus the
//!    configured shares of the active containers that are not paused (an
//!    active uncapped or `disable` container claims everything, so nothing
//!    is lent beside it). The pool is split in proportion to the borrowers'
//!    configured shares, each up to its burst share (water-filling, in
//!    integer basis points, leftovers of the division are not lent). It is
//!    taken back on the monitor's next pass after an owner becomes active.
//!    A borrower is never given a whole device (at most 99.99 %): at 100 %
//!    the shim stops metering launches, and the monitor would no longer see
//!    that the borrower is active.
//! 4. `force` and `disable` containers are never written (they ignore the
//!    effective share anyway), and neither is a container whose policy field
//!    holds an unknown value.
//! 5. **Contention.** Two processes on one GPU take the device in turns,
//!    and each switch between them costs device time that no container is
//!    given: two containers at 30 and 70 % ran their kernels 97 % of the
//!    time on an H200 between them, not 100 %. A container at its share
//!    waits for tokens; one that does not wait and still falls short of
//!    its share while the GPU is saturated is being held back by that loss
//!    alone, and it would bear all of it. So when the GPU is busy at least
//!    [`SATURATED`] and such a *short* container (active, capped, no wait
//!    in the window, more than [`SHORT_BY`] below its share) is among the
//!    active `default`-policy containers, the containers that did wait get
//!    their share scaled by what the active containers achieved together
//!    over what they were given (never below [`MIN_SCALE`]), so the loss is
//!    shared in proportion to the shares: 29.1 and 67.9 % on that GPU
//!    instead of 30 and 66.7. Nothing changes while no container is short.

use std::cmp::Ordering;
use vgpu_node_contract::region::UtilizationPolicy;
use vgpu_node_contract::region::{SHARE_FULL, SHARE_UNLIMITED};

/// Largest share lending may grant (see rule 3).
pub const MAX_LENT_SHARE: u32 = SHARE_FULL - 1;
/// A GPU busy this much of the window is saturated (rule 5), in basis points.
pub const SATURATED: u32 = 9_000;
/// A container this far below its share without waiting is short (rule 5),
/// in basis points: more than the window's measuring noise.
pub const SHORT_BY: u32 = 100;
/// Contention never scales a share below this fraction of itself (rule 5),
/// in basis points: a loss larger than this is not switching.
pub const MIN_SCALE: u32 = 8_000;

/// What one container did with a GPU over the monitor's window (rule 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// Device time it was granted per wall time, in basis points.
    pub achieved: u32,
    /// Some launch waited for tokens.
    pub waited: bool,
}

/// One container's view of one GPU, as arbitration needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Contender {
    /// Stable identity, used only to order ties deterministically.
    pub key: String,
    /// `None`: the policy field holds an unknown value (left alone).
    pub policy: Option<UtilizationPolicy>,
    /// Lower is more important.
    pub priority: i32,
    /// Configured share in basis points; `None` when uncapped.
    pub share: Option<u32>,
    /// Burst share in basis points (at least `share` when capped).
    pub burst: u32,
    /// Launched work within the activity window.
    pub active: bool,
    /// Its use of the GPU over the window, where the shim meters it.
    pub load: Option<Load>,
}

impl Contender {
    /// Builds a contender from raw region values, clamping whatever a
    /// container may have written: a share of 0 or 100 % and above is
    /// uncapped, a burst below the share is the share, above 100 % is 100 %.
    pub fn from_raw(
        key: String,
        policy_raw: u32,
        priority: i32,
        sm_limit_percent: u32,
        sm_burst_percent: u32,
        active: bool,
    ) -> Self {
        let share = (sm_limit_percent > 0 && sm_limit_percent < 100)
            .then(|| sm_limit_percent.saturating_mul(SHARE_FULL / 100));
        let burst = match share {
            Some(share) => sm_burst_percent
                .min(100)
                .saturating_mul(SHARE_FULL / 100)
                .max(share),
            None => SHARE_FULL,
        };
        Self {
            key,
            policy: UtilizationPolicy::from_u32(policy_raw),
            priority,
            share,
            burst,
            active,
            load: None,
        }
    }

    /// The same contender with what it did over the window.
    pub fn with_load(self, load: Option<Load>) -> Self {
        Self { load, ..self }
    }

    /// What the container claims of the device while it runs.
    fn claim(&self) -> u32 {
        match (self.policy, self.share) {
            (Some(UtilizationPolicy::Disable), _) | (_, None) => SHARE_FULL,
            (_, Some(share)) => share,
        }
    }
}

/// The decision for one contender: `Some(basis points or SHARE_UNLIMITED)`
/// to write into its region, `None` to leave its region alone.
pub type Decision = Option<u32>;

/// Decides every contender's effective share on one GPU, whose busy time
/// over the window (basis points, NVML's) is `gpu_busy` where known. The
/// result is in the same order as `contenders`.
pub fn arbitrate(contenders: &[Contender], gpu_busy: Option<u32>) -> Vec<Decision> {
    let top = contenders
        .iter()
        .filter(|c| c.active)
        .map(|c| c.priority)
        .min();
    let paused = |c: &Contender| {
        c.policy == Some(UtilizationPolicy::Default) && top.is_some_and(|top| c.priority > top)
    };
    let claimed: u32 = contenders
        .iter()
        .filter(|c| c.active && !paused(c))
        .fold(0u32, |sum, c| sum.saturating_add(c.claim()));
    let mut pool = SHARE_FULL.saturating_sub(claimed);

    let mut decisions: Vec<Decision> = contenders
        .iter()
        .map(|c| match c.policy {
            Some(UtilizationPolicy::Default) if paused(c) => Some(0),
            Some(UtilizationPolicy::Default) => Some(c.share.unwrap_or(SHARE_UNLIMITED)),
            _ => None,
        })
        .collect();

    // Borrowers in a deterministic order (by key), so ties and leftovers
    // never depend on the order regions were found in.
    let mut borrowers: Vec<usize> = contenders
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            c.active
                && c.policy == Some(UtilizationPolicy::Default)
                && !paused(c)
                && c.share.is_some_and(|share| c.burst > share)
        })
        .map(|(index, _)| index)
        .collect();
    borrowers.sort_by(|a, b| match contenders[*a].key.cmp(&contenders[*b].key) {
        Ordering::Equal => a.cmp(b),
        other => other,
    });
    let mut lent = vec![0u32; contenders.len()];
    // Water-filling: each round splits what is left among the borrowers
    // still wanting more, in proportion to their shares. A round either
    // satisfies a borrower or hands out the whole pool (less rounding), so
    // the number of rounds is bounded by the number of borrowers.
    for _ in 0..=borrowers.len() {
        let wanting: Vec<usize> = borrowers
            .iter()
            .copied()
            .filter(|&i| want(&contenders[i], lent[i]) > 0)
            .collect();
        let weight: u64 = wanting
            .iter()
            .map(|&i| u64::from(contenders[i].share.unwrap_or(0)))
            .sum();
        if pool == 0 || wanting.is_empty() || weight == 0 {
            break;
        }
        let mut given_this_round = 0u32;
        for &i in &wanting {
            let share = u64::from(contenders[i].share.unwrap_or(0));
            let portion = (u64::from(pool) * share / weight) as u32;
            let grant = portion.min(want(&contenders[i], lent[i]));
            lent[i] = lent[i].saturating_add(grant);
            given_this_round = given_this_round.saturating_add(grant);
        }
        pool = pool.saturating_sub(given_this_round);
        if given_this_round == 0 {
            break;
        }
    }
    for &i in &borrowers {
        if let (Some(share), Some(decision)) = (contenders[i].share, decisions[i].as_mut()) {
            *decision = share.saturating_add(lent[i]).min(MAX_LENT_SHARE);
        }
    }
    if let Some(scale) = contention_scale(contenders, &decisions, gpu_busy) {
        for (c, decision) in contenders.iter().zip(decisions.iter_mut()) {
            let waited = c.load.is_some_and(|load| load.waited);
            if let (true, true, Some(share), Some(d)) =
                (c.active, waited, c.share, decision.as_mut())
            {
                if *d == share {
                    *d = (u64::from(share) * u64::from(scale) / u64::from(SHARE_FULL)) as u32;
                }
            }
        }
    }
    decisions
}

/// Rule 5: the factor (basis points) by which the shares of containers that
/// waited are scaled, when a container is short on a saturated GPU.
fn contention_scale(
    contenders: &[Contender],
    decisions: &[Decision],
    gpu_busy: Option<u32>,
) -> Option<u32> {
    // The running default-policy containers, each capped and metered: an
    // uncapped or unmetered one among them leaves nothing to share out.
    let running: Vec<(&Contender, u32, Load)> = contenders
        .iter()
        .zip(decisions)
        .filter(|(c, d)| c.active && d.is_some_and(|d| d > 0))
        .map(|(c, d)| Some((c, d.filter(|&d| d <= SHARE_FULL)?, c.load?)))
        .collect::<Option<Vec<_>>>()?;
    if running.len() < 2
        || contenders
            .iter()
            .any(|c| c.active && c.policy != Some(UtilizationPolicy::Default))
    {
        return None;
    }
    let given: u64 = running.iter().map(|(_, d, _)| u64::from(*d)).sum();
    let achieved: u64 = running.iter().map(|(_, _, l)| u64::from(l.achieved)).sum();
    let busy = gpu_busy.map_or(achieved, u64::from);
    let short = running
        .iter()
        .any(|(_, d, l)| !l.waited && l.achieved.saturating_add(SHORT_BY) < *d);
    let waiting = running.iter().any(|(_, _, l)| l.waited);
    if !short || !waiting || busy < u64::from(SATURATED) || achieved >= given {
        return None;
    }
    let scale = (achieved * u64::from(SHARE_FULL) / given) as u32;
    Some(scale.max(MIN_SCALE))
}

/// How much more a borrower may be lent.
fn want(contender: &Contender, lent: u32) -> u32 {
    let share = contender.share.unwrap_or(0);
    contender
        .burst
        .min(MAX_LENT_SHARE)
        .saturating_sub(share)
        .saturating_sub(lent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn capped(key: &str, priority: i32, share: u32, burst: u32, active: bool) -> Contender {
        Contender::from_raw(key.into(), 0, priority, share, burst, active)
    }

    fn uncapped(key: &str, priority: i32, active: bool) -> Contender {
        Contender::from_raw(key.into(), 0, priority, 0, 0, active)
    }

    #[test]
    fn nobody_active_everybody_keeps_the_configured_share() {
        let out = arbitrate(
            &[
                capped("a", 0, 30, 90, false),
                capped("b", 1, 50, 50, false),
                uncapped("c", 2, false),
            ],
            None,
        );
        assert_eq!(out, vec![Some(3000), Some(5000), Some(SHARE_UNLIMITED)]);
    }

    #[test]
    fn an_active_higher_priority_pauses_lower_ones_capped_or_not() {
        let out = arbitrate(
            &[
                capped("high", 0, 30, 30, true),
                capped("low", 1, 60, 60, true),
                uncapped("low-uncapped", 5, true),
                capped("low-idle", 3, 10, 10, false),
            ],
            None,
        );
        assert_eq!(out, vec![Some(3000), Some(0), Some(0), Some(0)]);
    }

    #[test]
    fn an_idle_higher_priority_keeps_its_share_and_pauses_nobody() {
        let out = arbitrate(
            &[
                capped("high", 0, 30, 30, false),
                capped("low", 1, 60, 60, true),
            ],
            None,
        );
        assert_eq!(out, vec![Some(3000), Some(6000)]);
    }

    #[test]
    fn idle_capacity_is_lent_up_to_the_burst_and_taken_back() {
        // Owner b idle: a borrows up to its burst.
        let out = arbitrate(
            &[capped("a", 1, 30, 90, true), capped("b", 1, 50, 50, false)],
            None,
        );
        assert_eq!(out, vec![Some(9000), Some(5000)]);
        // b returns: only what neither claims is lent.
        let out = arbitrate(
            &[capped("a", 1, 30, 90, true), capped("b", 1, 50, 50, true)],
            None,
        );
        assert_eq!(out, vec![Some(5000), Some(5000)]);
    }

    #[test]
    fn the_pool_is_split_in_proportion_to_shares() {
        let out = arbitrate(
            &[capped("a", 1, 20, 100, true), capped("b", 1, 40, 100, true)],
            None,
        );
        // Pool 40 %: a gets a third, b two thirds.
        assert_eq!(out, vec![Some(2000 + 1333), Some(4000 + 2666)]);
        // A borrower that is satisfied early leaves the rest to the others.
        let out = arbitrate(
            &[capped("a", 1, 20, 25, true), capped("b", 1, 40, 100, true)],
            None,
        );
        assert_eq!(out, vec![Some(2500), Some(7500)]);
    }

    #[test]
    fn lending_never_grants_a_whole_device() {
        let out = arbitrate(&[capped("a", 1, 50, 100, true)], None);
        assert_eq!(out, vec![Some(MAX_LENT_SHARE)]);
    }

    #[test]
    fn nothing_is_lent_beside_an_active_uncapped_or_disabled_container() {
        let out = arbitrate(
            &[capped("a", 1, 30, 90, true), uncapped("b", 1, true)],
            None,
        );
        assert_eq!(out, vec![Some(3000), Some(SHARE_UNLIMITED)]);
        let mut disabled = capped("d", 1, 30, 30, true);
        disabled.policy = Some(UtilizationPolicy::Disable);
        let out = arbitrate(&[capped("a", 1, 30, 90, true), disabled], None);
        assert_eq!(out, vec![Some(3000), None]);
    }

    #[test]
    fn force_and_disable_are_left_alone_but_their_activity_counts() {
        let mut forced = capped("f", 0, 40, 40, true);
        forced.policy = Some(UtilizationPolicy::Force);
        let mut unknown = capped("u", 1, 40, 40, true);
        unknown.policy = None;
        let out = arbitrate(&[forced, capped("low", 1, 40, 90, true), unknown], None);
        assert_eq!(out, vec![None, Some(0), None]);
    }

    #[test]
    fn lower_priorities_do_not_borrow_while_paused() {
        let out = arbitrate(
            &[
                capped("high", 0, 20, 20, true),
                capped("low", 1, 20, 90, true),
            ],
            None,
        );
        assert_eq!(out, vec![Some(2000), Some(0)]);
    }

    fn loaded(c: Contender, achieved: u32, waited: bool) -> Contender {
        c.with_load(Some(Load { achieved, waited }))
    }

    #[test]
    fn a_short_container_on_a_saturated_gpu_shares_the_switching_loss() {
        // As measured on an H200: the 30 waits for tokens and gets 31.7 %,
        // the 70 never waits and gets 65 %, the GPU is busy 97 %.
        let pair = [
            loaded(capped("thirty", 1, 30, 30, true), 3170, true),
            loaded(capped("seventy", 1, 70, 70, true), 6500, false),
        ];
        let out = arbitrate(&pair, Some(9700));
        // The 30 is scaled by 96.7 %, the 70 keeps its share.
        assert_eq!(out, vec![Some(2901), Some(7000)]);
        // Without NVML the containers' own sum stands for the GPU's busy time.
        assert_eq!(arbitrate(&pair, None), out);
    }

    #[test]
    fn contention_changes_nothing_unless_a_container_is_short_on_a_saturated_gpu() {
        let thirty = |achieved, waited| loaded(capped("thirty", 1, 30, 30, true), achieved, waited);
        let seventy =
            |achieved, waited| loaded(capped("seventy", 1, 70, 70, true), achieved, waited);
        let unchanged = vec![Some(3000), Some(7000)];
        // The GPU has room: the 70 simply asks for less.
        assert_eq!(
            arbitrate(&[thirty(3000, true), seventy(4000, false)], Some(7000)),
            unchanged
        );
        // Nobody short: within a point of the share is measuring noise.
        assert_eq!(
            arbitrate(&[thirty(3000, true), seventy(6950, false)], Some(9950)),
            unchanged
        );
        // Nobody waited: the loss already falls on both.
        assert_eq!(
            arbitrate(&[thirty(2900, false), seventy(6800, false)], Some(9700)),
            unchanged
        );
        // An unmetered container among them: nothing to share out.
        let unmetered = capped("seventy", 1, 70, 70, true);
        assert_eq!(
            arbitrate(&[thirty(3170, true), unmetered], Some(9700)),
            unchanged
        );
        // Beside an active uncapped container nothing is scaled either.
        let out = arbitrate(
            &[thirty(3170, true), uncapped("u", 1, true).with_load(None)],
            Some(9700),
        );
        assert_eq!(out, vec![Some(3000), Some(SHARE_UNLIMITED)]);
    }

    #[test]
    fn contention_never_scales_a_share_below_its_floor_nor_touches_a_borrower() {
        let out = arbitrate(
            &[
                loaded(capped("a", 1, 30, 30, true), 1000, true),
                loaded(capped("b", 1, 70, 70, true), 2000, false),
            ],
            Some(9500),
        );
        assert_eq!(out, vec![Some(3000 * MIN_SCALE / SHARE_FULL), Some(7000)]);
        // A borrower's decision is above its share: lending stands.
        let out = arbitrate(
            &[
                loaded(capped("a", 1, 20, 60, true), 5900, true),
                loaded(capped("b", 1, 40, 40, true), 3500, false),
            ],
            Some(9600),
        );
        assert_eq!(out, vec![Some(6000), Some(4000)]);
    }

    #[test]
    fn raw_values_are_clamped() {
        let c = Contender::from_raw("x".into(), 0, 0, 500, 7, true);
        assert_eq!(c.share, None, "a share of 100 % or more is uncapped");
        let c = Contender::from_raw("x".into(), 0, 0, 40, 7, true);
        assert_eq!((c.share, c.burst), (Some(4000), 4000), "burst below share");
        let c = Contender::from_raw("x".into(), 0, 0, 40, u32::MAX, true);
        assert_eq!(c.burst, SHARE_FULL);
        let c = Contender::from_raw("x".into(), 99, 0, 40, 40, true);
        assert_eq!(c.policy, None);
    }

    fn contender() -> impl Strategy<Value = Contender> {
        (
            0u32..4,
            -3i32..3,
            0u32..120,
            0u32..200,
            any::<bool>(),
            "[a-e]",
        )
            .prop_map(|(policy, priority, share, burst, active, key)| {
                Contender::from_raw(key, policy, priority, share, burst, active)
            })
    }

    proptest! {
        #[test]
        fn decisions_are_sound(contenders in proptest::collection::vec(contender(), 0..8)) {
            let out = arbitrate(&contenders, None);
            prop_assert_eq!(out.len(), contenders.len());
            let top = contenders.iter().filter(|c| c.active).map(|c| c.priority).min();
            let mut lent_total = 0u64;
            for (c, d) in contenders.iter().zip(&out) {
                match c.policy {
                    Some(UtilizationPolicy::Default) => {
                        let d = d.expect("default-policy containers are decided");
                        if top.is_some_and(|top| c.priority > top) {
                            prop_assert_eq!(d, 0);
                        } else if let Some(share) = c.share {
                            // Never below the configured share, never above the burst.
                            prop_assert!(d >= share);
                            prop_assert!(d <= c.burst.max(share).min(MAX_LENT_SHARE).max(share));
                            lent_total += u64::from(d - share);
                        } else {
                            prop_assert_eq!(d, SHARE_UNLIMITED);
                        }
                    }
                    _ => prop_assert_eq!(*d, None),
                }
            }
            // What is lent never exceeds what the running containers leave.
            let claimed: u64 = contenders
                .iter()
                .filter(|c| c.active && !(c.policy == Some(UtilizationPolicy::Default)
                    && top.is_some_and(|top| c.priority > top)))
                .map(|c| u64::from(c.claim()))
                .sum();
            prop_assert!(lent_total <= u64::from(SHARE_FULL).saturating_sub(claimed));
            // Deterministic: the same input gives the same output.
            prop_assert_eq!(arbitrate(&contenders, None), out);
        }
    }
}
