// load: 1 publisher -> N subscribers through the getlantern/pubsub Go client
// (client.go, unchanged), against the Go broker or `sbus gateway`.
//
// Protocol with tools/bench_gateway.py: prints "ready" once every subscriber has
// received a probe (their subscriptions are in force), waits for a line on stdin,
// then publishes -messages messages, keeping at most -window in flight past the
// slowest subscriber, and prints one line "sent delivered seconds" when every
// subscriber has all of them or nothing arrived for -quiet.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/getlantern/pubsub"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:7000", "broker or gateway address")
	authkey := flag.String("authkey", "", "key the publisher authenticates with")
	subscribers := flag.Int("subscribers", 1, "subscribing clients")
	messages := flag.Int("messages", 100000, "messages to publish")
	size := flag.Int("size", 100, "body bytes")
	window := flag.Int("window", 50, "messages in flight past the slowest subscriber")
	quiet := flag.Duration("quiet", 2*time.Second, "give up after this long without a delivery")
	flag.Parse()

	dial := func() (net.Conn, error) { return net.Dial("tcp", *addr) }
	topic := []byte("bench/lantern")
	counts := make([]int64, *subscribers)
	probed := make([]int32, *subscribers)
	var last atomic.Int64 // UnixNano of the latest delivery
	for i := 0; i < *subscribers; i++ {
		c := pubsub.Connect(&pubsub.ClientConfig{Dial: dial})
		c.Subscribe(topic)
		go func(i int, c *pubsub.Client) {
			for {
				m := c.Read()
				if len(m.Body) > 0 && m.Body[0] == 'p' {
					atomic.StoreInt32(&probed[i], 1)
					continue
				}
				atomic.AddInt64(&counts[i], 1)
				last.Store(time.Now().UnixNano())
			}
		}(i, c)
	}
	pub := pubsub.Connect(&pubsub.ClientConfig{Dial: dial, AuthenticationKey: *authkey})
	for deadline := time.Now().Add(30 * time.Second); ; {
		all := true
		for i := range probed {
			if atomic.LoadInt32(&probed[i]) == 0 {
				all = false
			}
		}
		if all {
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintln(os.Stderr, "the subscriptions never took effect")
			os.Exit(1)
		}
		pub.Publish(topic, []byte("p"))
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // late probes drain
	fmt.Println("ready")
	bufio.NewReader(os.Stdin).ReadString('\n')

	body := make([]byte, *size)
	for i := range body {
		body[i] = 'm'
	}
	low := func() int64 {
		m := atomic.LoadInt64(&counts[0])
		for i := range counts {
			if n := atomic.LoadInt64(&counts[i]); n < m {
				m = n
			}
		}
		return m
	}
	start := time.Now()
	last.Store(start.UnixNano())
	quietFor := func() bool { return time.Since(time.Unix(0, last.Load())) > *quiet }
	sent := 0
	for sent < *messages {
		if int64(sent)-low() >= int64(*window) {
			if quietFor() {
				break // losses: the window never reopens
			}
			time.Sleep(20 * time.Microsecond)
			continue
		}
		pub.Publish(topic, body)
		sent++
	}
	for low() < int64(sent) && !quietFor() {
		time.Sleep(time.Millisecond)
	}
	var delivered int64
	for i := range counts {
		delivered += atomic.LoadInt64(&counts[i])
	}
	elapsed := time.Duration(last.Load() - start.UnixNano())
	fmt.Printf("%d %d %.6f\n", sent, delivered, elapsed.Seconds())
}
